#!/usr/bin/env bash
# Builds the bench's stargz-snapshotter peer (see README.md here) into
# ${STARGZ_BIN_DIR:-~/.cache/tilefs-bench/stargz-VERSION}: stargz-serve and
# stargz-convert, with the versions go.mod and go.sum pin, from the Go
# module proxy. Prints the directory. Does nothing when both are there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '$1 == "github.com/containerd/stargz-snapshotter" {print $2}' "$here/go.mod")
out=${STARGZ_BIN_DIR:-$HOME/.cache/tilefs-bench/stargz-$version}
if [ -x "$out/stargz-serve" ] && [ -x "$out/stargz-convert" ] && [ -s "$out/BUILD" ]; then
    echo "$out"
    exit 0
fi
go_bin=$(command -v go || echo /usr/local/go/bin/go)
if [ ! -x "$go_bin" ]; then
    echo "stargz peer: Go is needed to build it" >&2
    exit 1
fi
mkdir -p "$out"
cd "$here"
# -mod=readonly: go.sum must already name every module (no silent upgrade).
GOFLAGS="-mod=readonly -buildvcs=false" "$go_bin" build -trimpath -o "$out/stargz-serve" ./serve
GOFLAGS="-mod=readonly -buildvcs=false" "$go_bin" build -trimpath -o "$out/stargz-convert" ./convert
echo "stargz-snapshotter $version (library, module proxy), estargz $version; $("$go_bin" version | cut -d' ' -f3); go build -trimpath (default -O: Go's optimizing compiler)" > "$out/BUILD"
echo "$out"
