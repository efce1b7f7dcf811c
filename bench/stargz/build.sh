#!/usr/bin/env bash
# Builds the bench's stargz-snapshotter peer (see README.md here) into
# ${STARGZ_BIN_DIR:-~/.cache/tilefs-bench/stargz-VERSION}: stargz-serve and
# stargz-convert, with the versions go.mod and go.sum pin, from the Go
# module proxy. Prints the directory. Does nothing when both are there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../../scripts/go-build.sh"
version=$(awk '$1 == "github.com/containerd/stargz-snapshotter" {print $2}' "$here/go.mod")
out=${STARGZ_BIN_DIR:-$HOME/.cache/tilefs-bench/stargz-$version}
go_cached "$out" stargz-serve stargz-convert BUILD
go_find "stargz peer" 1
mkdir -p "$out"
cd "$here"
go_build "$out/stargz-serve" ./serve -trimpath
go_build "$out/stargz-convert" ./convert -trimpath
echo "stargz-snapshotter $version (library, module proxy), estargz $version; $(go_version); go build -trimpath (default -O: Go's optimizing compiler)" > "$out/BUILD"
echo "$out"
