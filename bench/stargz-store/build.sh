#!/usr/bin/env bash
# Builds the podman section's stargz-store (see README.md here) into
# ${STARGZ_STORE_BIN_DIR:-~/.cache/tilefs-bench/stargz-store-VERSION}: the
# project's own command, at the version go.mod and go.sum pin, from the Go
# module proxy. Prints the directory. Does nothing when it is there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../../scripts/go-build.sh"
version=$(awk '$1 == "github.com/containerd/stargz-snapshotter" {print $2}' "$here/go.mod")
out=${STARGZ_STORE_BIN_DIR:-$HOME/.cache/tilefs-bench/stargz-store-$version}
go_cached "$out" stargz-store BUILD
go_find stargz-store 1
mkdir -p "$out"
cd "$here"
go_build "$out/stargz-store" github.com/containerd/stargz-snapshotter/cmd/stargz-store -trimpath
echo "stargz-store $version (its command, module proxy); $(go_version); go build -trimpath (default -O: Go's optimizing compiler)" > "$out/BUILD"
echo "$out"
