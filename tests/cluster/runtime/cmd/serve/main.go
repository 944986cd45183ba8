// Command serve is the serving container of the tests' predictor pods: a stand-in for a model
// server (KServe's huggingfaceserver loads a model the same way) that reads every file of the model
// folder before it says Ready, so a pod's start costs what loading the weights costs.
//
// Each *.safetensors file is checked against its own header (8-byte little-endian header length, a
// JSON header whose tensors' data_offsets must tile the data section exactly, each tensor's size
// matching its dtype and shape); any other file is read whole. With --digest=sha256 each file's
// digest is logged, so a test can compare the bytes the container read with the origin's. A file
// that fails its check ends the process (exit 1: the pod never becomes Ready).
//
// It answers KServe's readiness routes: GET /v1/models/<name> and /v2/models/<name>/ready (200
// once loaded, 503 before), and /v2/health/ready.
package main

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"log"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// dtypeBytes is the size of one element of each safetensors dtype.
var dtypeBytes = map[string]uint64{
	"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
	"I16": 2, "U16": 2, "F16": 2, "BF16": 2,
	"I32": 4, "U32": 4, "F32": 4,
	"I64": 8, "U64": 8, "F64": 8,
}

type tensor struct {
	Dtype       string   `json:"dtype"`
	Shape       []uint64 `json:"shape"`
	DataOffsets []uint64 `json:"data_offsets"`
}

// checkSafetensors reads the header of f and returns where the data section starts and how long it is.
func checkSafetensors(f *os.File, size int64) (int64, error) {
	var n uint64
	if err := binary.Read(f, binary.LittleEndian, &n); err != nil {
		return 0, fmt.Errorf("no header length: %w", err)
	}
	if n > 100<<20 || int64(8+n) > size {
		return 0, fmt.Errorf("header length %d does not fit a file of %d bytes", n, size)
	}
	raw := make([]byte, n)
	if _, err := io.ReadFull(f, raw); err != nil {
		return 0, fmt.Errorf("header: %w", err)
	}
	var header map[string]json.RawMessage
	if err := json.Unmarshal(raw, &header); err != nil {
		return 0, fmt.Errorf("header is not JSON: %w", err)
	}
	type span struct{ begin, end uint64 }
	var spans []span
	for name, value := range header {
		if name == "__metadata__" {
			continue
		}
		var t tensor
		if err := json.Unmarshal(value, &t); err != nil || len(t.DataOffsets) != 2 {
			return 0, fmt.Errorf("tensor %q: malformed entry", name)
		}
		width, ok := dtypeBytes[t.Dtype]
		if !ok {
			return 0, fmt.Errorf("tensor %q: unknown dtype %q", name, t.Dtype)
		}
		elements := uint64(1)
		for _, d := range t.Shape {
			elements *= d
		}
		if t.DataOffsets[1] < t.DataOffsets[0] || t.DataOffsets[1]-t.DataOffsets[0] != elements*width {
			return 0, fmt.Errorf("tensor %q: data_offsets %v do not hold %s%v", name, t.DataOffsets, t.Dtype, t.Shape)
		}
		spans = append(spans, span{t.DataOffsets[0], t.DataOffsets[1]})
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].begin < spans[j].begin })
	end := uint64(0)
	for _, s := range spans {
		if s.begin != end {
			return 0, fmt.Errorf("tensor data is not contiguous at byte %d", end)
		}
		end = s.end
	}
	if data := uint64(size) - 8 - n; end != data {
		return 0, fmt.Errorf("the header's tensors hold %d bytes, the file's data section %d", end, data)
	}
	return int64(8 + n), nil
}

// load reads one file whole; returns its digest ("" without one).
func load(path string, digest bool, buf []byte) (int64, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, "", err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return 0, "", err
	}
	if strings.HasSuffix(path, ".safetensors") {
		if _, err := checkSafetensors(f, info.Size()); err != nil {
			return 0, "", err
		}
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return 0, "", err
		}
	}
	var h hash.Hash
	var sink io.Writer = io.Discard
	if digest {
		h = sha256.New()
		sink = h
	}
	read, err := io.CopyBuffer(sink, struct{ io.Reader }{f}, buf)
	if err != nil {
		return read, "", err
	}
	if read != info.Size() {
		return read, "", fmt.Errorf("read %d bytes of %d", read, info.Size())
	}
	if h == nil {
		return read, "", nil
	}
	return read, hex.EncodeToString(h.Sum(nil)), nil
}

func main() {
	name := flag.String("model-name", "", "the model's name in /v1/models/<name>")
	dir := flag.String("model-dir", "/mnt/models", "the folder the model was put in")
	port := flag.Int("port", 8080, "HTTP port")
	digest := flag.String("digest", "sha256", "sha256: log each file's digest; none: read only")
	flag.Parse()
	if *name == "" || (*digest != "sha256" && *digest != "none") {
		log.Fatal("serve: --model-name is required; --digest is sha256 or none")
	}
	log.SetFlags(0)
	var ready atomic.Bool
	mux := http.NewServeMux()
	answer := func(w http.ResponseWriter, body any) {
		w.Header().Set("Content-Type", "application/json")
		if !ready.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(body)
	}
	mux.HandleFunc("GET /v1/models/"+*name, func(w http.ResponseWriter, _ *http.Request) {
		answer(w, map[string]any{"name": *name, "ready": ready.Load()})
	})
	mux.HandleFunc("GET /v2/models/"+*name+"/ready", func(w http.ResponseWriter, _ *http.Request) {
		answer(w, map[string]any{"name": *name, "ready": ready.Load()})
	})
	mux.HandleFunc("GET /v2/health/ready", func(w http.ResponseWriter, _ *http.Request) {
		answer(w, map[string]any{"ready": ready.Load()})
	})
	go func() {
		if err := http.ListenAndServe(fmt.Sprintf(":%d", *port), mux); err != nil {
			log.Fatalf("serve: %v", err)
		}
	}()
	go func() {
		stop := make(chan os.Signal, 1)
		signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
		<-stop
		os.Exit(0)
	}()

	started := time.Now()
	var files, total int64
	buf := make([]byte, 4<<20)
	err := filepath.WalkDir(*dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		n, sum, err := load(path, *digest == "sha256", buf)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		rel, _ := filepath.Rel(*dir, path)
		if sum != "" {
			log.Printf("serve: file %s %d bytes sha256:%s", rel, n, sum)
		}
		files++
		total += n
		return nil
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		log.Fatalf("serve: model %s: %v", *name, err)
	}
	seconds := time.Since(started).Seconds()
	log.Printf("serve: loaded model %s from %s: %d files, %d bytes in %.2f s", *name, *dir, files, total, seconds)
	ready.Store(true)
	select {}
}
