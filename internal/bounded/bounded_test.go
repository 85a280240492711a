package bounded_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"pdcluster.dev/pdcluster-operator/internal/bounded"
)

func TestReadAll(t *testing.T) {
	cases := []struct {
		name    string
		body    string
		limit   int
		wantErr bool
	}{
		{"under", "abc", 4, false},
		{"at the limit", "abcd", 4, false},
		{"past the limit", "abcde", 4, true},
		{"empty", "", 0, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b, err := bounded.ReadAll(strings.NewReader(tc.body), tc.limit)
			if tc.wantErr {
				if !errors.Is(err, bounded.ErrTooLarge) || b != nil {
					t.Fatalf("ReadAll = %q, %v; want ErrTooLarge and nothing", b, err)
				}
				return
			}
			if err != nil || string(b) != tc.body {
				t.Fatalf("ReadAll = %q, %v; want %q", b, err, tc.body)
			}
		})
	}
}

func TestSnippetIsBoundedAndTrimmed(t *testing.T) {
	if got := bounded.Snippet(strings.NewReader("  engine overloaded\n")); got != "engine overloaded" {
		t.Errorf("Snippet = %q", got)
	}
	if got := bounded.Snippet(strings.NewReader(strings.Repeat("x", 1<<20))); len(got) != 4<<10 {
		t.Errorf("Snippet of 1 MiB = %d bytes, want 4 KiB", len(got))
	}
}

func TestNoRedirectIsNotFollowed(t *testing.T) {
	var followed int
	target := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { followed++ }))
	defer target.Close()
	src := httptest.NewServer(http.RedirectHandler(target.URL, http.StatusFound))
	defer src.Close()
	hc := &http.Client{CheckRedirect: bounded.NoRedirect}
	_, err := hc.Get(src.URL)
	if !errors.Is(err, bounded.ErrRedirect) || followed != 0 {
		t.Fatalf("Get = %v, target asked %d times; want ErrRedirect and 0", err, followed)
	}
}
