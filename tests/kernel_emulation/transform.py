"""Rewrites a CUDA kernel source so that the host compiler can build it and run it on the CPU.

Part of the kernel-emulation tests (tests/kernel_emulation, docs/gpu.md): CMake runs this on a
kernel source (kernels/attention/flash_attention.cu, kernels/dropout/dropout.cu,
kernels/sparse/sparse24.cu) at build time and
compiles the output, together with the emulation headers next to this script, into the kernel's
emulated test program. Everything that is not a
rewrite listed here stays as written, so the test runs the kernel's real index math, fragment
layouts and barriers.

Rewrites:
  - `#include "dir/name.cuh"` (a kernel's own device headers, found from the kernels folder, the
    input's parent's parent) -> the header's text, itself rewritten the same way, between #line
    directives; a header already inlined is left out, as its `#pragma once` would;
  - `#include <cuda_runtime.h>` -> the emulated runtime (emulated_cuda_runtime.h): threads as
    fibers, __syncthreads, shuffles, the launch, the runtime API calls the host code makes;
  - `#include "common/ptx.h"` (the shared PTX wrappers: cp.async, ldmatrix, mma.sync, mma.sp)
    -> `#include "emulated_ptx.h"` (their emulation);
  - a kernel's own PTX wrapper functions (inline asm: flash attention's float2 atomic add)
    -> the emulated instructions (emulated_*.h), included where the first wrapper was;
  - `extern __shared__ ... name[];` -> a pointer to the emulated block's shared memory;
  - `kernel<<<grid, block, smem, stream>>>(args)` -> emulated_launch(kernel, grid, block, smem,
    stream, args).
Removed code is replaced by blank lines and the output starts with a #line directive, so compiler
messages and debuggers point at the real kernel source.

Every rewrite checks its anchor: if the kernel changes so that an anchor is missing, or so that
something the emulation cannot run appears (inline asm outside the wrappers, static __shared__
arrays, __CUDA_ARCH__ branches, a launch syntax not matched), this exits non-zero with a message
naming it. A kernel edit that breaks the emulation stops the build instead of being skipped.

Usage: transform.py INPUT.cu OUTPUT [--wrappers NAME,...] [--no-shared] [--mutate OLD NEW]...
--wrappers names the PTX wrappers the kernel must define (default: DEFAULT_WRAPPERS, which is
flash attention's set, in flash_attention_tiles.cuh; an empty list for a kernel without inline PTX); --no-shared: the
kernel has no extern __shared__ array. Either way a wrapper or array the kernel has but the
command line does not name is left behind and caught by the leftover checks.
--mutate replaces the first occurrence of OLD by NEW in the input, its headers inlined, before
the rewrites (OLD must occur): a
deliberately broken kernel, to check that the test catches it (docs/gpu.md).
"""
import argparse
import os
import re
import sys

# A kernel's own PTX wrappers, by function name, and the header that emulates each one.
EMULATED_WRAPPERS = {
    "atomic_add2": "emulated_atomics.h",
}
# The default --wrappers: flash attention's own, in flash_attention_tiles.cuh (the others are in
# common/ptx.h).
DEFAULT_WRAPPERS = ["atomic_add2"]
RUNTIME_INCLUDE = "#include <cuda_runtime.h>"
EMULATED_RUNTIME_INCLUDE = '#include "emulated_cuda_runtime.h"'
# The shared PTX wrappers (kernels/common/ptx.h) and their emulation.
PTX_INCLUDE = '#include "common/ptx.h"'
EMULATED_PTX_INCLUDE = '#include "emulated_ptx.h"'
LOCAL_HEADER_INCLUDE = re.compile(r'^\s*#\s*include\s+"([\w/.-]+\.cuh)"\s*(?://.*)?$')
EXTERN_SHARED = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?unsigned char (\w+)\[\];")
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\s*\(")


class TransformError(Exception):
    pass


def inline_local_headers(source, path, root, seen):
    """`source` (the text of `path`) with each `#include "X.cuh"` replaced by the text of
    root/X.cuh, recursively; `seen` holds the headers already inlined."""
    out = []
    for number, line in enumerate(source.split("\n"), start=1):
        match = LOCAL_HEADER_INCLUDE.match(line)
        if not match:
            out.append(line)
            continue
        header = os.path.join(root, match.group(1))
        if header in seen:
            out.append("")
            continue
        seen.add(header)
        try:
            with open(header, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise TransformError(f"{path}:{number}: cannot read {header}: {e}") from None
        text = inline_local_headers(text, header, root, seen)
        # `#pragma once` in what is now the main file would draw a warning.
        lines = ["" if l.strip() == "#pragma once" else l for l in text.rstrip("\n").split("\n")]
        out.append(f'#line 1 "{header}"')
        out.extend(lines)
        out.append(f'#line {number + 1} "{path}"')
    return "\n".join(out)


def remove_function(lines, name):
    """Blanks out the definition of function `name` (with its template line, if any): from its
    first line, `__device__ ... name(`, to the first line that is exactly `}`. Returns the index
    of the first blanked line."""
    head = re.compile(r"^__device__ __forceinline__ .*\b" + re.escape(name) + r"\(")
    starts = [i for i, line in enumerate(lines) if head.match(line)]
    if len(starts) != 1:
        raise TransformError(
            f"anchor '__device__ __forceinline__ ... {name}(' found {len(starts)} times "
            "(expected once): the PTX wrapper it emulates was renamed, moved or duplicated")
    first = starts[0]
    if first > 0 and lines[first - 1].startswith("template <"):
        first -= 1
    try:
        last = lines.index("}", starts[0])
    except ValueError:
        raise TransformError(f"anchor: no closing '}}' line after function {name}") from None
    for i in range(first, last + 1):
        lines[i] = ""
    return first


def transform(source, wrappers, shared):
    lines = source.split("\n")

    # Each may appear again in an inlined header; the emulated ones are #pragma once.
    runtime = [i for i, line in enumerate(lines) if line == RUNTIME_INCLUDE]
    if not runtime:
        raise TransformError(f"anchor '{RUNTIME_INCLUDE}' not found")
    for i in runtime:
        lines[i] = EMULATED_RUNTIME_INCLUDE
    ptx = [i for i, line in enumerate(lines) if line == PTX_INCLUDE]
    for i in ptx:
        if i < runtime[0]:
            raise TransformError(f"'{PTX_INCLUDE}' comes before '{RUNTIME_INCLUDE}'")
        lines[i] = EMULATED_PTX_INCLUDE

    starts = {name: remove_function(lines, name) for name in wrappers}
    if starts:
        # One #include per line, on the blank lines where the first wrapper was.
        headers = list(dict.fromkeys(EMULATED_WRAPPERS[name] for name in wrappers))
        first = min(starts.values())
        if any(lines[first + i] for i in range(len(headers))):
            raise TransformError(f"no {len(headers)} blank lines for the emulation headers at "
                                 f"line {first + 1} (the first PTX wrapper is shorter than that)")
        for i, h in enumerate(headers):
            lines[first + i] = f'#include "{h}"'

    text = "\n".join(lines)
    text, n_shared = EXTERN_SHARED.subn(r"unsigned char* \1 = emulated_dynamic_shared_memory();",
                                        text)
    if shared and n_shared == 0:
        raise TransformError(
            "anchor 'extern __shared__ __align__(16) unsigned char NAME[];' not found")
    text, n_launch = LAUNCH.subn(r"emulated_launch(\1, \2, ", text)
    if n_launch == 0:
        raise TransformError("anchor 'kernel<<<grid, block, smem, stream>>>(args)' not found")

    # What the emulation cannot run must not be left behind.
    leftovers = {
        r"\basm\b": "inline asm outside the emulated PTX wrappers",
        r"__shared__": "a __shared__ variable other than one extern dynamic array",
        r"<<<": "a kernel launch the launch pattern did not match",
        r"__CUDA_ARCH__": "a __CUDA_ARCH__ branch (the emulation would take the host branch)",
        r"#\s*include.*\.cuh": "a kernel header include not inlined (write it as "
                                '#include "dir/name.cuh")',
    }
    for number, line in enumerate(text.split("\n"), start=1):
        code = line.split("//")[0]
        for pattern, what in leftovers.items():
            if re.search(pattern, code):
                raise TransformError(f"line {number}: {what}: {line.strip()}")
    return text, n_launch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input", help="the kernel source (.cu)")
    parser.add_argument("output", help="the rewritten source to write")
    parser.add_argument("--wrappers", default=",".join(DEFAULT_WRAPPERS),
                        help="comma-separated PTX wrappers the kernel defines (may be empty)")
    parser.add_argument("--no-shared", action="store_true",
                        help="the kernel has no extern __shared__ array")
    parser.add_argument("--mutate", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                        help="replace the first OLD by NEW in the input first")
    args = parser.parse_args()
    wrappers = [w for w in args.wrappers.split(",") if w]
    unknown = [w for w in wrappers if w not in EMULATED_WRAPPERS]
    if unknown:
        sys.exit(f"transform.py: --wrappers: no emulation for {', '.join(unknown)} (known: "
                 f"{', '.join(EMULATED_WRAPPERS)})")

    path = os.path.abspath(args.input)
    with open(args.input, encoding="utf-8") as f:
        source = f.read()
    try:
        source = inline_local_headers(source, path, os.path.dirname(os.path.dirname(path)), set())
    except TransformError as e:
        sys.exit(f"transform.py: {e}")
    for old, new in args.mutate:
        if old not in source:
            sys.exit(f"transform.py: --mutate: '{old}' does not occur in {args.input} or the "
                     "headers it inlines")
        source = source.replace(old, new, 1)
    try:
        text, n_launch = transform(source, wrappers, not args.no_shared)
    except TransformError as e:
        sys.exit(f"transform.py: {args.input}: {e}\n(the kernel changed in a way the emulation "
                 "does not know: update tests/kernel_emulation to match)")

    header = (f"// Generated by tests/kernel_emulation/transform.py from {path}; do not edit.\n"
              f'#line 1 "{path}"\n')
    tmp = args.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(header + text)
    os.replace(tmp, args.output)
    print(f"transform.py: {args.output}: {len(wrappers)} PTX wrappers emulated, "
          f"{n_launch} launches")


if __name__ == "__main__":
    main()
