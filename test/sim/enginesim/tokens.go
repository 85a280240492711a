package enginesim

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"strings"
)

// vocab is the simulator's vocabulary size; token ids are in [0, vocab).
const vocab = 50_000

// tokenize turns text into token ids, one per whitespace-separated word: good enough to make
// prompt length and prefix sharing behave as with a real tokenizer.
func tokenize(text string) []int {
	words := strings.Fields(text)
	out := make([]int, len(words))
	for i, w := range words {
		h := fnv.New32a()
		_, _ = h.Write([]byte(w))
		out[i] = int(h.Sum32() % vocab)
	}
	return out
}

// detokenize renders generated token ids.
func detokenize(id int) string { return fmt.Sprintf(" t%d", id) }

// blockHashes chains a hash over each block of tokens, the partial last one included: a
// block's hash covers every token before it, so equal hashes mean equal prefixes. vLLM's
// prefix cache keys whole blocks only (the first len(tokens)/blockSize); the partial block's
// hash names the KV it holds, which moves to decode as the whole blocks' does.
func blockHashes(tokens []int, blockSize int) []uint64 {
	n := (len(tokens) + blockSize - 1) / blockSize
	out := make([]uint64, n)
	var prev uint64
	var buf [8]byte
	for b := 0; b < n; b++ {
		h := fnv.New64a()
		binary.LittleEndian.PutUint64(buf[:], prev)
		_, _ = h.Write(buf[:])
		for _, t := range tokens[b*blockSize : min((b+1)*blockSize, len(tokens))] {
			binary.LittleEndian.PutUint64(buf[:], uint64(t))
			_, _ = h.Write(buf[:])
		}
		prev = h.Sum64()
		out[b] = prev
	}
	return out
}

// blockContent is the simulated KV of a block: bytes determined by the block's chain hash, so
// a consumer can verify that what it received is the KV of its own prompt.
func blockContent(hash uint64, buf []byte) {
	x := hash | 1
	for i := 0; i+8 <= len(buf); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(buf[i:], x)
	}
	for i := len(buf) &^ 7; i < len(buf); i++ {
		buf[i] = byte(hash >> (8 * (i % 8)))
	}
}

// nextToken is the simulated model: a deterministic function of the prompt and position.
func nextToken(seed uint64, pos int) int {
	x := seed ^ uint64(pos+1)*0x9E3779B97F4A7C15
	x ^= x >> 31
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 29
	return int(x % vocab)
}
