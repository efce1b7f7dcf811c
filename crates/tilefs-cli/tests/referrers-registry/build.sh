#!/usr/bin/env bash
# Builds referrers-registry (see main.go), with the versions go.mod and
# go.sum pin, from the Go module proxy, into
# ~/.cache/tilefs-test/referrers-registry-KEY (KEY: a hash of go.mod, go.sum
# and main.go, so a change rebuilds). Prints the directory. Does nothing
# when it is there. Exits 3 when Go is not installed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
key=$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" | sha256sum | cut -c1-12)
out=$HOME/.cache/tilefs-test/referrers-registry-$key
if [ -x "$out/referrers-registry" ]; then
    echo "$out"
    exit 0
fi
go_bin=$(command -v go || echo /usr/local/go/bin/go)
if [ ! -x "$go_bin" ]; then
    echo "referrers-registry: Go is needed to build it" >&2
    exit 3
fi
mkdir -p "$out"
cd "$here"
# -mod=readonly: go.sum must already name every module (no silent upgrade).
GOFLAGS="-mod=readonly -buildvcs=false" "$go_bin" build -trimpath -o "$out/referrers-registry.tmp" .
mv "$out/referrers-registry.tmp" "$out/referrers-registry"
echo "$out"
