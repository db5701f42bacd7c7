#!/usr/bin/env bash
# Build kvpool.protocol._copyhash (copyhash.c) next to the Python sources of kvpool.protocol,
# for the Python given as $1 (default: python3). Needs gcc, that Python's headers and
# xxhash.h (Debian: libxxhash-dev). KVPOOL_NATIVE_CFLAGS replaces the default flags (e.g.
# without -march=native when the build machine is not the one that runs it).
# kvpool runs without it (kvpool.protocol.copyhash falls back to pure Python).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${1:-python3}"
inc="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
suffix="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
out="$here/../_copyhash$suffix"
flags="${KVPOOL_NATIVE_CFLAGS:--O3 -march=native}"
gcc $flags -shared -fPIC -Wall -Werror -I"$inc" "$here/copyhash.c" -o "$out.tmp"
mv "$out.tmp" "$out"
echo "built $out"
