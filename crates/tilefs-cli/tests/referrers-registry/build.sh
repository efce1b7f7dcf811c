#!/usr/bin/env bash
# Builds referrers-registry (see main.go), with the versions go.mod and
# go.sum pin, from the Go module proxy, into
# ~/.cache/tilefs-test/referrers-registry-KEY (KEY: a hash of go.mod, go.sum
# and main.go, so a change rebuilds). Prints the directory. Does nothing
# when it is there. Exits 3 when Go is not installed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../../../../scripts/go-build.sh"
key=$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" | sha256sum | cut -c1-12)
out=$HOME/.cache/tilefs-test/referrers-registry-$key
go_cached "$out" referrers-registry
go_find referrers-registry 3
mkdir -p "$out"
cd "$here"
go_build "$out/referrers-registry" . -trimpath
echo "$out"
