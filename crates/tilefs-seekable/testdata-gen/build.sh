#!/usr/bin/env bash
# Builds seekable-gen (see README.md here), with the versions go.mod and
# go.sum pin, from the Go module proxy, into
# ${SEEKABLE_GEN_DIR:-~/.cache/tilefs-test/seekable-gen-KEY} (KEY: a hash of
# go.mod, go.sum and main.go, so a change rebuilds). Prints the directory.
# Does nothing when it is there. Exits 3 when Go is not installed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../../../scripts/go-build.sh"
key=$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" | sha256sum | cut -c1-12)
out=${SEEKABLE_GEN_DIR:-$HOME/.cache/tilefs-test/seekable-gen-$key}
go_cached "$out" seekable-gen
go_find seekable-gen 3
mkdir -p "$out"
cd "$here"
go_build "$out/seekable-gen" . -trimpath
echo "$out"
