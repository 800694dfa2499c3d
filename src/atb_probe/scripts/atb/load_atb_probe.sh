# Load the atb-probe dump module into every Python process started from this shell.
#
#   source load_atb_probe.sh [--output=<dir>] [--config=<file>]
#
# --output  where atb_dump_data/ is written (default: the current directory)
# --config  the dump config file (default: config.json beside this script); it may be created
#           later, while the program runs.
# Undo with: source unload_atb_probe.sh

_atb_probe_load() {
    local script_dir output config arg
    script_dir="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)"
    output="$PWD"
    config="$script_dir/config.json"
    if [ "$#" -gt 2 ]; then
        echo "[atb-probe] WARNING: at most two arguments (--output=<dir> --config=<file>); got $#. Nothing was loaded." >&2
        return 1
    fi
    for arg in "$@"; do
        case "$arg" in
            --output=*) output="${arg#--output=}" ;;
            --config=*) config="${arg#--config=}" ;;
            *)
                echo "[atb-probe] WARNING: unknown argument '$arg' (expected --output=<dir> or --config=<file>). Nothing was loaded." >&2
                return 1 ;;
        esac
    done
    if [ -z "$output" ] || [ -z "$config" ]; then
        echo "[atb-probe] WARNING: empty --output or --config. Nothing was loaded." >&2
        return 1
    fi
    case "$output" in /*) ;; *) output="$PWD/$output" ;; esac
    case "$config" in /*) ;; *) config="$PWD/$config" ;; esac

    local boot="$script_dir/../../_bootstrap"
    boot="$(cd "$boot" && pwd)"
    # Loading twice must not add twice: take out a previous load's entry first.
    if [ -n "${ATB_PROBE_BOOTSTRAP:-}" ]; then
        local p=":${PYTHONPATH:-}:"
        p="${p/":$ATB_PROBE_BOOTSTRAP:"/:}"
        p="${p#:}"
        PYTHONPATH="${p%:}"
    elif [ -n "${PYTHONPATH+x}" ]; then
        export ATB_PROBE_PYTHONPATH_WAS_SET=1
    else
        export ATB_PROBE_PYTHONPATH_WAS_SET=0
    fi
    if [ -n "${PYTHONPATH:-}" ]; then
        export PYTHONPATH="$boot:$PYTHONPATH"
    else
        export PYTHONPATH="$boot"
    fi
    export ATB_PROBE_BOOTSTRAP="$boot"
    export ATB_OUTPUT_DIR="$output"
    export ATB_DUMP_CONFIG="$config"
    echo "[atb-probe] loaded: output=$output/atb_dump_data config=$config" >&2
    if [ ! -e "$config" ]; then
        echo "[atb-probe] $config does not exist (yet): programs started from this shell load the probe asleep and dump nothing until it is written with \"dump_enable\": true" >&2
    fi
}

_atb_probe_load "$@"
