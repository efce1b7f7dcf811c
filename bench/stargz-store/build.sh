#!/usr/bin/env bash
# Builds the podman section's stargz-store (see README.md here) into
# ${STARGZ_STORE_BIN_DIR:-~/.cache/tilefs-bench/stargz-store-VERSION}: the
# project's own command, at the version go.mod and go.sum pin, from the Go
# module proxy. Prints the directory. Does nothing when it is there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '$1 == "github.com/containerd/stargz-snapshotter" {print $2}' "$here/go.mod")
out=${STARGZ_STORE_BIN_DIR:-$HOME/.cache/tilefs-bench/stargz-store-$version}
if [ -x "$out/stargz-store" ] && [ -s "$out/BUILD" ]; then
    echo "$out"
    exit 0
fi
go_bin=$(command -v go || echo /usr/local/go/bin/go)
if [ ! -x "$go_bin" ]; then
    echo "stargz-store: Go is needed to build it" >&2
    exit 1
fi
mkdir -p "$out"
cd "$here"
# -mod=readonly: go.sum must already name every module (no silent upgrade).
GOFLAGS="-mod=readonly -buildvcs=false" "$go_bin" build -trimpath -o "$out/stargz-store" \
    github.com/containerd/stargz-snapshotter/cmd/stargz-store
echo "stargz-store $version (its command, module proxy); $("$go_bin" version | cut -d' ' -f3); go build -trimpath (default -O: Go's optimizing compiler)" > "$out/BUILD"
echo "$out"
