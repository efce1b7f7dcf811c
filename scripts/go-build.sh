# Sourced by the build.sh scripts that build a pinned Go program into a
# cache directory (bench/stargz, bench/soci, bench/stargz-store,
# crates/tilefs-cli/tests/referrers-registry,
# crates/tilefs-seekable/testdata-gen). Each says what it builds and where;
# this holds the steps they share: nothing to do when the directory holds
# it, Go found or a clear exit, go build with go.sum as pinned.

# go_cached OUT NAME...: when OUT holds every NAME (an executable, or
# BUILD, the record of how it was built, non-empty), prints OUT and exits 0.
go_cached() {
    local out=$1 name
    shift
    for name in "$@"; do
        if [ "$name" = BUILD ]; then
            [ -s "$out/BUILD" ] || return 0
        else
            [ -x "$out/$name" ] || return 0
        fi
    done
    echo "$out"
    exit 0
}

# go_find WHAT STATUS: sets go_bin to the go command, or says that WHAT
# needs Go and exits with STATUS.
go_find() {
    go_bin=$(command -v go || echo /usr/local/go/bin/go)
    if [ ! -x "$go_bin" ]; then
        echo "$1: Go is needed to build it" >&2
        exit "$2"
    fi
}

# go_build OUT_FILE PACKAGE [GO BUILD ARGS...]: builds PACKAGE of the module
# in the current directory into OUT_FILE, whole or not at all (a build
# cut short leaves no program that looks built). -mod=readonly: go.sum
# must already name every module (no silent upgrade).
go_build() {
    local out=$1 pkg=$2
    shift 2
    GOFLAGS="-mod=readonly -buildvcs=false" "$go_bin" build "$@" -o "$out.tmp" "$pkg"
    mv "$out.tmp" "$out"
}

# go_version: the go command's version (go1.N.M), for BUILD records.
go_version() {
    "$go_bin" version | cut -d' ' -f3
}
