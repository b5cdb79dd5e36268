#!/usr/bin/env python3
"""Checks the committed UCX bindings (src/transport/ucx/sys.rs, generated from UCX 1.13's headers) against
another UCX's headers: every struct and union they declare must be a prefix of the other's (same fields,
same types, same order: the newer library may only append), every constant the same value, every bound
function the same signature. Then one build loads either library.

    kv-transfer/scripts/check-ucx-abi.py /path/to/ucx/include     # e.g. the libucx-cu13 wheel's libucx/include

Needs bindgen and libclang (as gen-ucx-bindings.sh). Exits non-zero on any difference that matters;
constants the bindings do not use are reported but not counted when only their enum's end marker moved."""
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMITTED = HERE.parent / "src/transport/ucx/sys.rs"
# The API version (we ask for 1.13's, which newer libraries accept) and enum end markers that grow when a
# release adds members: not part of any layout.
MOVABLE = {"ucs_memory_type_UCS_MEMORY_TYPE_LAST", "ucs_memory_type_UCS_MEMORY_TYPE_UNKNOWN", "UCP_API_MINOR"}


def bindings(include: Path) -> str:
    gen = (HERE / "gen-ucx-bindings.sh").read_text()
    funcs = re.search(r"FUNCS=\((.*?)\)", gen, re.S).group(1).split()
    args = ["bindgen", str(include / "ucp/api/ucp.h"), "--dynamic-loading", "UcpLib", "--dynamic-link-require-all"]
    for f in funcs:
        args += ["--allowlist-function", f]
    args += ["--allowlist-type", "uc[spt]_.*", "--allowlist-var", "UC[SPT]_.*", "--newtype-enum", "ucs_status_t",
             "--bitfield-enum", "ucp_feature", "--bitfield-enum", ".*_field", "--bitfield-enum", ".*_flags(_t)?",
             "--no-layout-tests", "--no-doc-comments", "--use-core", "--", f"-I{include}"]
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def parse(text: str):
    structs = {}
    for m in re.finditer(r"pub (?:struct|union) (\w+) \{(.*?)\n\}", text, re.S):
        structs[m.group(1)] = [l.strip().rstrip(",") for l in m.group(2).split("\n") if l.strip().startswith("pub ")]
    consts = {m.group(1): m.group(2).strip() for m in re.finditer(r"pub const (\w+): [\w:]+ = ([^;]+);", text)}
    lib = re.search(r"pub struct UcpLib \{(.*?)\n\}", text, re.S).group(1)
    fns = {m.group(1): re.sub(r"\s+", " ", m.group(2)) for m in re.finditer(r"pub (\w+):\s*(unsafe extern \"C\" fn\(.*?\)(?: -> [^,]+)?),", lib, re.S)}
    structs.pop("UcpLib", None)
    return structs, consts, fns


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    ours, theirs = parse(COMMITTED.read_text()), parse(bindings(Path(sys.argv[1])))
    bad = 0
    for name, fields in ours[0].items():
        other = theirs[0].get(name)
        if other is None:
            print(f"struct {name}: missing"); bad += 1
        elif other[: len(fields)] != fields:
            # A renamed padding field of the same type keeps the layout.
            same = len(other) >= len(fields) and all(a.split(":")[1] == b.split(":")[1] for a, b in zip(fields, other))
            print(f"struct {name}: {'renamed fields, same layout' if same else 'DIFFERS'}\n  ours   {fields}\n  theirs {other[:len(fields)]}")
            bad += not same
    for name, value in ours[1].items():
        if name in theirs[1] and theirs[1][name] != value:
            print(f"const {name}: {value} -> {theirs[1][name]}{' (version or enum end: no layout)' if name in MOVABLE else ''}")
            bad += name not in MOVABLE
    for name, sig in ours[2].items():
        if theirs[2].get(name) != sig:
            print(f"fn {name}: DIFFERS\n  ours   {sig}\n  theirs {theirs[2].get(name)}"); bad += 1
    print(f"{len(ours[0])} structs, {len(ours[1])} constants, {len(ours[2])} functions checked: {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
