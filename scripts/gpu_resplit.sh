#!/usr/bin/env bash
# Re-split the GPU bundle (../shared/gpu/build_bundle.sh writes .gpu/site.part-00..02 of up to
# 44 MiB) into smaller parts, so that a part + this repository's working tree (which carries the
# ~24 MiB demo pair in sglang_ddtree/assets/demo) + the JIT cache stay under the device tool's
# 64 MiB per call. Rewrites .gpu/MANIFEST; `.gpu/device.sh stash` / `env` work unchanged.
#   bash scripts/gpu_resplit.sh [MIB]   (default 26)  -> prints the parts to carry, one per call
set -euo pipefail
cd "$(dirname "$0")/../.gpu"
mib=${1:-26}
sha256sum -c --quiet MANIFEST || { echo "bundle parts do not match MANIFEST" >&2; exit 1; }
tmp=$(mktemp -d .resplit.XXXX)
cat site.part-* > "$tmp/site.tar.xz"
rm -f site.part-*
split -b "${mib}M" -d -a 2 "$tmp/site.tar.xz" site.part-
rm -rf "$tmp"
sha256sum site.part-* > MANIFEST
ls -la site.part-* MANIFEST
