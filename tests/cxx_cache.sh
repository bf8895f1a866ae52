#!/usr/bin/env bash
# The C++ compiler of the suite's Inductor compiles (tests/conftest.py names it in CXX): g++, with every kernel library
# it builds kept in $H3SERVE_TEST_CXX_STORE under a key of its source and command line, so a kernel that an earlier
# compile of the run built (the compile tests compile the same tiny DiT into fresh compile caches on purpose) is
# copied instead of built again. What torch caches, and so what the tests check, is untouched: only g++ is skipped.
# The key keeps each path's file name and drops its directory: every test's compile cache is another directory, and
# Inductor names its sources and precompiled headers by a hash of what they hold.
set -euo pipefail
store=${H3SERVE_TEST_CXX_STORE:?names the directory of the built kernels}
args=("$@") out="" src=""
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    -o) out=${args[i + 1]} ;;
    *.cpp) src=${args[i]} ;;
  esac
done
[[ $out == *.so && -n $src ]] || exec g++ "$@"  # the precompiled header, version probes: as they are
key=$({ for arg in "${args[@]}"; do [[ $arg == /* ]] && arg=${arg##*/}; printf '%s\n' "$arg"; done; cat "$src"; } |
  sha256sum | cut -c1-40)
if [[ -f $store/$key ]]; then
  exec cp "$store/$key" "$out"
fi
g++ "$@"
kept=$(mktemp "$store/.$key.XXXXXX")  # written whole, then renamed: a concurrent build of the key reads no half file
cp "$out" "$kept" && mv "$kept" "$store/$key"
