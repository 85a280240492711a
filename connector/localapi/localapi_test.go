package localapi_test

import (
	"net"
	"path/filepath"
	"testing"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/test/asuser"
)

// The engine's gate dials the agent's socket from another container, as another user (an
// engine image usually runs as root with every capability dropped, so without
// CAP_DAC_OVERRIDE): the socket the agent (65532) creates must accept it.
func TestSocketAcceptsTheEnginesUser(t *testing.T) {
	dir := asuser.SharedDir(t)
	path := filepath.Join(dir, "agent.sock")
	var l net.Listener
	if err := asuser.Do(t, 65532, func() (err error) { l, err = localapi.Listen("unix://" + path); return err }); err != nil {
		t.Fatalf("listen as the agent's user: %v", err)
	}
	defer l.Close()
	go func() {
		if c, err := l.Accept(); err == nil {
			c.Close()
		}
	}()
	if err := asuser.Do(t, asuser.Nobody, func() error {
		c, err := net.Dial("unix", path)
		if err == nil {
			c.Close()
		}
		return err
	}); err != nil {
		t.Fatalf("dial as the engine's user: %v", err)
	}
}
