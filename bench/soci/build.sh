#!/usr/bin/env bash
# Builds the bench's SOCI peer (see README.md here) into
# ${SOCI_BIN_DIR:-~/.cache/tilefs-bench/soci-VERSION}: soci and
# soci-snapshotter-grpc from awslabs/soci-snapshotter's Go modules, as its
# Makefile's release build does. Prints the directory. Does nothing when
# both are there.
set -euo pipefail
# The release and its command module: cmd/ is a module of its own that
# replaces the library with "../"; the proxy serves it at the pseudo-version
# of the release's commit (same time as the tag).
version=v0.16.1
cmd_version=v0.0.0-20260930233240-61147fe7c929
out=${SOCI_BIN_DIR:-$HOME/.cache/tilefs-bench/soci-$version}
if [ -x "$out/soci" ] && [ -x "$out/soci-snapshotter-grpc" ] && [ -s "$out/BUILD" ]; then
    echo "$out"
    exit 0
fi
go_bin=$(command -v go || echo /usr/local/go/bin/go)
if [ ! -x "$go_bin" ]; then
    echo "SOCI peer: Go is needed to build it" >&2
    exit 1
fi
if [ ! -e /usr/lib/x86_64-linux-gnu/libz.a ] && [ ! -e /usr/local/lib/libz.a ]; then
    echo "SOCI peer: zlib's static library is needed (Debian: zlib1g-dev)" >&2
    exit 1
fi
src=$(mktemp -d)
trap 'chmod -R u+w "$src"; rm -rf "$src"' EXIT
cd "$src"
lib_dir=$(GOFLAGS=-mod=mod "$go_bin" mod download -json "github.com/awslabs/soci-snapshotter@$version" |
    sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
cmd_dir=$(GOFLAGS=-mod=mod "$go_bin" mod download -json "github.com/awslabs/soci-snapshotter/cmd@$cmd_version" |
    sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
# The repository's layout again: the library with cmd/ inside it.
cp -r "$lib_dir" tree
chmod -R u+w tree
cp -r "$cmd_dir" tree/cmd
chmod -R u+w tree/cmd
mkdir -p "$out"
cd tree/cmd
pkg=github.com/awslabs/soci-snapshotter
# The Makefile's flags: version stamped, -s -w; cgo links zlib's libz.a.
ldflags="-X $pkg/version.Version=$version -X $pkg/version.Revision=$version -s -w"
for c in soci-snapshotter-grpc soci; do
    GOFLAGS="-mod=readonly -buildvcs=false" "$go_bin" build -o "$out/$c" -ldflags "$ldflags" "./$c"
done
echo "soci-snapshotter $version (module proxy: the library at $version, its cmd module at $cmd_version, the release's commit); $("$go_bin" version | cut -d' ' -f3); the Makefile's release build: go build -ldflags '-X version... -s -w' (Go's optimizing compiler), cgo with Debian's zlib $(dpkg-query -W -f '${Version}' zlib1g-dev 2>/dev/null || echo '?') static libz.a" > "$out/BUILD"
echo "$out"
