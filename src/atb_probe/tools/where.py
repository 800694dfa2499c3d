"""`atb-probe where`: the folder of the load/unload scripts and the example config.json."""
from __future__ import annotations

import os


def scripts_dir() -> str:
    import atb_probe
    return os.path.join(os.path.dirname(os.path.abspath(atb_probe.__file__)), "scripts", "atb")


def register(sub) -> None:
    p = sub.add_parser("where", help="print the folder of load_atb_probe.sh",
                       description="Print the folder holding load_atb_probe.sh, "
                                   "unload_atb_probe.sh and an example config.json.",
                       epilog='example: source "$(atb-probe where)/load_atb_probe.sh" '
                              '--output=$PWD --config=$PWD/config.json')
    p.set_defaults(func=lambda args: print(scripts_dir()))
