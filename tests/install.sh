#!/usr/bin/env bash
# install.sh: make install into a temporary prefix, then what a user of the C library does there:
# the README's C example (tools/example.c) built with pkg-config, shared and static, and run; the
# installed command run. Also that libmok.so exports mok.h's functions and nothing else. Run by
# make test from the repository root, after the build; prints one line per check and
# "N passed, N failed"; exit status 1 if any failed.
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

# A make of its own (not this one's sub-make): everything is built already.
check install/make_install 0 '' -- env -u MAKEFLAGS -u MAKELEVEL make -s install PREFIX="$prefix"
v=$(sed -n 's/^Version: //p' "$prefix/lib/pkgconfig/mok.pc")
check install/files 0 '' -- test -f "$prefix/include/mok.h" -a -f "$prefix/lib/libmok.a" \
  -a -f "$prefix/lib/libmok.so.$v" -a -L "$prefix/lib/libmok.so" -a -x "$prefix/bin/mok"
check install/only_the_public_header 0 '^mok.h $' -- sh -c "ls '$prefix/include' | tr '\n' ' '"
soname=$(readelf -d "$prefix/lib/libmok.so.$v" | sed -n 's/.*soname: \[\(.*\)\]/\1/p')
check install/soname_link 0 "^libmok.so.$v \$" -- readlink "$prefix/lib/$soname"

# libmok.so's exports are exactly the functions mok.h declares: not the generator, the float64
# recomputation, the backends or the CUDA runtime linked into it.
declared=$(grep -o 'mok_[a-z0-9_]*(' include/mok.h | tr -d '(' | sort -u)
exported=$(nm -D --defined-only "$prefix/lib/libmok.so" | awk '{print $3}' | sort -u)
check install/exports_are_mok_h 0 '' -- diff <(echo "$declared") <(echo "$exported")
check install/no_generator_or_oracle 1 '' -- grep -Eq 'mok_(gen|ref64|host_layer|fail)' \
  <<<"$exported"

export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
check install/pkg_config 0 "^-I$prefix/include -L$prefix/lib -lmok  \$" -- \
  pkg-config --cflags --libs mok
# The README's command, with the README's example; it runs against the installed libmok.so.
check install/example_builds 0 '' -- \
  sh -c "cc -std=c11 -Wall -Wextra -Werror tools/example.c \$(pkg-config --cflags --libs mok) -o '$tmp/example'"
check install/example_runs 0 '^y\[0\] = ' -- env LD_LIBRARY_PATH="$prefix/lib" "$tmp/example"
check install/example_uses_installed_so 0 "$soname => $prefix/lib/$soname" -- \
  env LD_LIBRARY_PATH="$prefix/lib" ldd "$tmp/example"
# Static: libmok.a with what mok.pc says it needs (Libs.private).
check install/example_static 0 '^y\[0\] = ' -- sh -c "cc -std=c11 tools/example.c \
  \$(pkg-config --cflags mok) -Wl,-Bstatic -lmok -Wl,-Bdynamic \$(pkg-config --static --libs mok) \
  -o '$tmp/example_static' && ! ldd '$tmp/example_static' | grep -q libmok && '$tmp/example_static'"
# The same bits from both, and from the example make test builds in the tree.
check install/same_result 0 '' -- sh -c "test \"\$(LD_LIBRARY_PATH='$prefix/lib' '$tmp/example')\" = \
  \"\$('$tmp/example_static')\" && test \"\$('$tmp/example_static')\" = \"\$(./build/example)\""
check install/command 0 'run: PASS' -- \
  "$prefix/bin/mok" run --shape fine-7b --scale 1/64 --backend cpu --check-rows 2
check install/uninstall 0 '' -- sh -c "env -u MAKEFLAGS -u MAKELEVEL make -s uninstall \
  PREFIX='$prefix' && test -z \"\$(find '$prefix' -type f -o -type l)\""

check_done
