#!/bin/sh
# Fills the seed corpora fuzz/corpus/{parse_dump,read_image,roundtrip_image}
# (git-ignored) from dump files, and fuzz/corpus/oci_layer from the layers
# of the limit tests in crates/tilefs-cli/tests/oci_pull.rs (names of 252-259
# bytes, whiteouts and opaque markers of them, paths past PATH_MAX, 4095-byte
# symlink targets, xattrs at their limits, and each one past its limit),
# which that test writes when TILEFS_WRITE_LAYER_SEEDS names a directory,
# and fuzz/corpus/virtio_request from well-formed virtqueues of requests
# (tilefs_vhost::fuzzing::seeds(), written by the test
# the_fuzz_seeds_are_well_formed_queues when TILEFS_WRITE_VIRTIO_SEEDS names
# a directory), and fuzz/corpus/seekable_* from real gzip, zstd, eStargz and
# zstd:chunked layers, their indexes, tables and footers (written by the
# test fuzz_seeds_are_valid_inputs of crates/tilefs-seekable/tests/toc.rs
# when TILEFS_WRITE_SEEKABLE_SEEDS names a directory).
# The dumps come from:
#   - fuzz/seeds/*.dump (small, in git),
#   - the small *.dump files of $ASSETS (composefs test vectors),
#   - any *.dump under the directories given as arguments.
# Dumps go to the parse_dump corpus as they are. Each dump is also built into
# images with tilefs and, if available, the reference mkcomposefs, at the
# three version settings (0-1, 0-0, 1-1); those images seed roundtrip_image,
# and the smaller ones read_image. Files are named by their sha256, so
# re-running only adds.
#
# Environment: TILEFS (default ../target/release/tilefs; build it with
# `cargo build --release --bin tilefs`), MKCOMPOSEFS (default: mkcomposefs
# from PATH, skipped if absent), ASSETS (default
# /work/shared/composefs-assets), MAX_DUMP (bytes, default 65536),
# MAX_IMAGE (bytes, default 262144), MAX_SMALL_IMAGE (default 65536).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
TILEFS=${TILEFS:-$here/../target/release/tilefs}
MKCOMPOSEFS=${MKCOMPOSEFS:-$(command -v mkcomposefs || true)}
ASSETS=${ASSETS:-/work/shared/composefs-assets}
MAX_DUMP=${MAX_DUMP:-65536}
MAX_IMAGE=${MAX_IMAGE:-262144}
MAX_SMALL_IMAGE=${MAX_SMALL_IMAGE:-65536}
[ -x "$TILEFS" ] || { echo "no tilefs binary at $TILEFS" >&2; exit 1; }
corpus=$here/corpus
mkdir -p "$corpus/parse_dump" "$corpus/read_image" "$corpus/roundtrip_image" "$corpus/oci_layer"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

size() { wc -c <"$1" | tr -d ' '; }
add() { # add FILE DIR: copy FILE into DIR named by its sha256
    cp "$1" "$2/$(sha256sum "$1" | cut -c1-40)"
}

{
    ls "$here"/seeds/*.dump
    [ -d "$ASSETS" ] && ls "$ASSETS"/*.dump
    for d in "$@"; do find "$d" -name '*.dump'; done
} | while read -r dump; do
    [ "$(size "$dump")" -le "$MAX_DUMP" ] || continue
    add "$dump" "$corpus/parse_dump"
    for v in "0 1" "0 0" "1 1"; do
        set -- $v
        img=$tmp/img
        for builder in tilefs mkcomposefs; do
            rm -f "$img"
            if [ $builder = tilefs ]; then
                "$TILEFS" build --from-dump --min-version "$1" --max-version "$2" "$dump" "$img" 2>/dev/null || true
            elif [ -n "$MKCOMPOSEFS" ]; then
                "$MKCOMPOSEFS" --from-file --min-version="$1" --max-version="$2" "$dump" "$img" 2>/dev/null || true
            fi
            [ -s "$img" ] || continue
            n=$(size "$img")
            [ "$n" -le "$MAX_IMAGE" ] && add "$img" "$corpus/roundtrip_image"
            [ "$n" -le "$MAX_SMALL_IMAGE" ] && add "$img" "$corpus/read_image"
        done
    done
done
(cd "$here/.." && TILEFS_WRITE_LAYER_SEEDS="$corpus/oci_layer" \
    cargo test -q --release --locked -p tilefs --test oci_pull names_and_paths_at_their_limits >/dev/null)
(cd "$here/.." && TILEFS_WRITE_VIRTIO_SEEDS="$corpus/virtio_request" \
    cargo test -q --release --locked -p tilefs-vhost --test chains the_fuzz_seeds_are_well_formed_queues >/dev/null)
(cd "$here/.." && TILEFS_WRITE_SEEKABLE_SEEDS="$corpus" \
    cargo test -q --release --locked -p tilefs-seekable --test toc fuzz_seeds_are_valid_inputs >/dev/null)
# oci_toc_lazy takes seekable_toc's inputs (a table, made into a lazy image).
mkdir -p "$corpus/oci_toc_lazy"
cp "$corpus/seekable_toc"/* "$corpus/oci_toc_lazy/"
for t in parse_dump read_image roundtrip_image oci_layer virtio_request \
    seekable_index seekable_gzip seekable_zstd seekable_toc seekable_footer oci_toc_lazy; do
    echo "$t: $(ls "$corpus/$t" | wc -l) seeds"
done
