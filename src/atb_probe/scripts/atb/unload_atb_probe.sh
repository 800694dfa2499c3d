# Undo load_atb_probe.sh: remove exactly what it added to PYTHONPATH and unset its variables.
#
#   source unload_atb_probe.sh

_atb_probe_unload() {
    if [ -z "${ATB_PROBE_BOOTSTRAP:-}" ]; then
        echo "[atb-probe] not loaded in this shell; nothing to unload" >&2
        unset ATB_OUTPUT_DIR ATB_DUMP_CONFIG
        return 0
    fi
    # Remove exactly the entry load added (once), keeping every other entry as it was.
    local p=":${PYTHONPATH:-}:"
    p="${p/":$ATB_PROBE_BOOTSTRAP:"/:}"
    p="${p#:}"
    p="${p%:}"
    if [ "${ATB_PROBE_PYTHONPATH_WAS_SET:-1}" = 0 ] && [ -z "$p" ]; then
        unset PYTHONPATH
    else
        export PYTHONPATH="$p"
    fi
    unset ATB_OUTPUT_DIR ATB_DUMP_CONFIG ATB_PROBE_BOOTSTRAP ATB_PROBE_PYTHONPATH_WAS_SET
    echo "[atb-probe] unloaded" >&2
}

_atb_probe_unload
unset -f _atb_probe_unload _atb_probe_load 2>/dev/null
