#!/usr/bin/env bash
# Builds the bench's SOCI peer (see README.md here) into
# ${SOCI_BIN_DIR:-~/.cache/tilefs-bench/soci-VERSION}: soci and
# soci-snapshotter-grpc from awslabs/soci-snapshotter's Go modules, as its
# Makefile's release build does. Prints the directory. Does nothing when
# both are there.
set -euo pipefail
. "$(cd "$(dirname "$0")" && pwd)/../../scripts/go-build.sh"
# The release and its command module: cmd/ is a module of its own that
# replaces the library with "../"; the proxy serves it at the pseudo-version
# of the release's commit (same time as the tag).
version=v0.16.1
cmd_version=v0.0.0-20260930233240-61147fe7c929
out=${SOCI_BIN_DIR:-$HOME/.cache/tilefs-bench/soci-$version}
go_cached "$out" soci soci-snapshotter-grpc BUILD
go_find "SOCI peer" 1
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
    go_build "$out/$c" "./$c" -ldflags "$ldflags"
done
echo "soci-snapshotter $version (module proxy: the library at $version, its cmd module at $cmd_version, the release's commit); $(go_version); the Makefile's release build: go build -ldflags '-X version... -s -w' (Go's optimizing compiler), cgo with Debian's zlib $(dpkg-query -W -f '${Version}' zlib1g-dev 2>/dev/null || echo '?') static libz.a" > "$out/BUILD"
echo "$out"
