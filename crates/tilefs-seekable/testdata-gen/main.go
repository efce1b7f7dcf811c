// seekable-gen writes eStargz and zstd:chunked layers from a tar archive,
// with the stargz project's estargz package and containers/storage's
// chunked compressor (the versions go.mod pins), for tilefs-seekable's
// tests. It prints the layer's annotations as one JSON object.
//
//	seekable-gen estargz [-chunk-size N] [-min-chunk-size N] [-level N] IN.tar OUT
//	seekable-gen zstd-chunked [-level N] IN.tar OUT
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/containerd/stargz-snapshotter/estargz"
	"go.podman.io/storage/pkg/chunked/compressor"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var annotations map[string]string
	var err error
	switch os.Args[1] {
	case "estargz":
		annotations, err = writeEstargz(os.Args[2:])
	case "zstd-chunked":
		annotations, err = writeZstdChunked(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "seekable-gen %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
	if err := json.NewEncoder(os.Stdout).Encode(annotations); err != nil {
		fmt.Fprintf(os.Stderr, "seekable-gen: %v\n", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: seekable-gen estargz [-chunk-size N] [-min-chunk-size N] [-level N] IN.tar OUT")
	fmt.Fprintln(os.Stderr, "       seekable-gen zstd-chunked [-level N] IN.tar OUT")
	os.Exit(2)
}

// paths parses the flags and returns the input and output paths.
func paths(fs *flag.FlagSet, args []string) (string, string) {
	if err := fs.Parse(args); err != nil || fs.NArg() != 2 {
		usage()
	}
	return fs.Arg(0), fs.Arg(1)
}

func writeEstargz(args []string) (map[string]string, error) {
	fs := flag.NewFlagSet("estargz", flag.ExitOnError)
	chunkSize := fs.Int("chunk-size", 0, "chunk size (0: the package's default, 4 MiB)")
	minChunkSize := fs.Int("min-chunk-size", 0, "files smaller than this share gzip members (0: never)")
	level := fs.Int("level", 6, "gzip level")
	in, out := paths(fs, args)
	f, err := os.Open(in)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	opts := []estargz.Option{estargz.WithCompressionLevel(*level), estargz.WithMinChunkSize(*minChunkSize)}
	if *chunkSize > 0 {
		opts = append(opts, estargz.WithChunkSize(*chunkSize))
	}
	blob, err := estargz.Build(io.NewSectionReader(f, 0, st.Size()), opts...)
	if err != nil {
		return nil, err
	}
	defer blob.Close()
	if err := writeFile(out, blob); err != nil {
		return nil, err
	}
	size, err := blob.UncompressedSize()
	if err != nil {
		return nil, err
	}
	return map[string]string{
		estargz.TOCJSONDigestAnnotation:         blob.TOCDigest().String(),
		estargz.StoreUncompressedSizeAnnotation: fmt.Sprint(size),
		"diffID":                                blob.DiffID().String(),
	}, nil
}

func writeZstdChunked(args []string) (map[string]string, error) {
	fs := flag.NewFlagSet("zstd-chunked", flag.ExitOnError)
	level := fs.Int("level", 3, "zstd level")
	in, out := paths(fs, args)
	f, err := os.Open(in)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	dst, err := os.Create(out)
	if err != nil {
		return nil, err
	}
	annotations := map[string]string{}
	w, err := compressor.ZstdCompressor(dst, annotations, level)
	if err != nil {
		dst.Close()
		return nil, err
	}
	if _, err := io.Copy(w, f); err != nil {
		w.Close()
		dst.Close()
		return nil, err
	}
	if err := w.Close(); err != nil {
		dst.Close()
		return nil, err
	}
	return annotations, dst.Close()
}

func writeFile(path string, r io.Reader) error {
	dst, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(dst, r); err != nil {
		dst.Close()
		return err
	}
	return dst.Close()
}
