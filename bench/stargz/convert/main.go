// Command stargz-convert turns an image of an OCI image layout into eStargz
// with stargz-snapshotter's estargz library (estargz.Build, its default
// options: gzip level 9, no prioritized files), into another layout. Each
// layer gets the annotations stargz-snapshotter reads: its TOC's digest and
// its uncompressed size; the configuration gets the new layers' diff IDs.
//
//	stargz-convert SRC-LAYOUT NAME DST-LAYOUT
package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

const refName = "org.opencontainers.image.ref.name"

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: stargz-convert SRC-LAYOUT NAME DST-LAYOUT")
		os.Exit(2)
	}
	if err := convert(os.Args[1], os.Args[2], os.Args[3]); err != nil {
		fmt.Fprintf(os.Stderr, "stargz-convert: %v\n", err)
		os.Exit(1)
	}
}

func blobPath(layout string, d digest.Digest) string {
	return filepath.Join(layout, "blobs", d.Algorithm().String(), d.Encoded())
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// writeBlob copies r into dst's blobs: its descriptor's digest and size.
func writeBlob(dst string, r io.Reader) (digest.Digest, int64, error) {
	dir := filepath.Join(dst, "blobs", "sha256")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", 0, err
	}
	f, err := os.CreateTemp(dir, ".tmp-")
	if err != nil {
		return "", 0, err
	}
	defer os.Remove(f.Name())
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", 0, err
	}
	d := digest.Digest("sha256:" + hex.EncodeToString(h.Sum(nil)))
	return d, n, os.Rename(f.Name(), filepath.Join(dir, d.Encoded()))
}

func writeJSONBlob(dst string, v any) (digest.Digest, int64, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return "", 0, err
	}
	return writeBlob(dst, bytes.NewReader(b))
}

func convert(src, name, dst string) error {
	var index ocispec.Index
	if err := readJSON(filepath.Join(src, "index.json"), &index); err != nil {
		return err
	}
	var mdesc *ocispec.Descriptor
	for i := range index.Manifests {
		if index.Manifests[i].Annotations[refName] == name {
			mdesc = &index.Manifests[i]
		}
	}
	if mdesc == nil {
		return fmt.Errorf("no image %q in %s", name, src)
	}
	var manifest ocispec.Manifest
	if err := readJSON(blobPath(src, mdesc.Digest), &manifest); err != nil {
		return err
	}
	var config map[string]any
	if err := readJSON(blobPath(src, manifest.Config.Digest), &config); err != nil {
		return err
	}
	var diffIDs []any
	var layers []ocispec.Descriptor
	for i, l := range manifest.Layers {
		f, err := os.Open(blobPath(src, l.Digest))
		if err != nil {
			return err
		}
		st, err := f.Stat()
		if err != nil {
			return err
		}
		// Build takes the layer as it is, gzip'd or not.
		blob, err := estargz.Build(io.NewSectionReader(f, 0, st.Size()))
		if err != nil {
			f.Close()
			return fmt.Errorf("layer %d (%s): %w", i, l.Digest, err)
		}
		d, n, err := writeBlob(dst, blob)
		blob.Close()
		f.Close()
		if err != nil {
			return err
		}
		usize, err := blob.UncompressedSize()
		if err != nil {
			return err
		}
		layers = append(layers, ocispec.Descriptor{
			MediaType: ocispec.MediaTypeImageLayerGzip,
			Digest:    d,
			Size:      n,
			Annotations: map[string]string{
				estargz.TOCJSONDigestAnnotation:         blob.TOCDigest().String(),
				estargz.StoreUncompressedSizeAnnotation: strconv.FormatInt(usize, 10),
			},
		})
		diffIDs = append(diffIDs, blob.DiffID().String())
		fmt.Fprintf(os.Stderr, "layer %d: %s -> %s (%d bytes, TOC %s)\n", i, l.Digest, d, n, blob.TOCDigest())
	}
	rootfs, _ := config["rootfs"].(map[string]any)
	if rootfs == nil {
		return fmt.Errorf("the configuration has no rootfs")
	}
	rootfs["diff_ids"] = diffIDs
	cd, cn, err := writeJSONBlob(dst, config)
	if err != nil {
		return err
	}
	manifest.Config.Digest, manifest.Config.Size = cd, cn
	manifest.Layers = layers
	md, mn, err := writeJSONBlob(dst, manifest)
	if err != nil {
		return err
	}
	out := ocispec.Index{
		Versioned: index.Versioned,
		MediaType: ocispec.MediaTypeImageIndex,
		Manifests: []ocispec.Descriptor{{
			MediaType:   ocispec.MediaTypeImageManifest,
			Digest:      md,
			Size:        mn,
			Annotations: map[string]string{refName: name},
		}},
	}
	if err := os.WriteFile(filepath.Join(dst, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644); err != nil {
		return err
	}
	b, err := json.Marshal(out)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dst, "index.json"), b, 0o644)
}
