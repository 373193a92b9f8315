"""The peak memory a jitted call reaches against what ``memory_analysis()`` predicted
(tests/jit: op nodes, the static memory plan)."""
import ctrainstate as cts


def measured_vs_predicted(j, *args):
    """({device id: (measured, predicted)}, outputs) of one replay of ``j``: the extra bytes
    each device's peak reached above what it held before the call, and ``memory_analysis()``'s
    peak less the arguments and constants (held before the call too)."""
    ma = j.lower(*args).compile().memory_analysis()
    devs = [d for d in cts.devices() if d.id in ma.per_device]
    cts.reset_peak_memory_stats()
    before = {d.id: d.memory_stats()["bytes_in_use"] for d in devs}
    out = j(*args)
    got = {}
    for d in devs:
        p = ma.per_device[d.id]
        predicted = p["peak_size_in_bytes"] - p["argument_size_in_bytes"] - p["constant_size_in_bytes"]
        got[d.id] = (d.memory_stats()["peak_bytes_in_use"] - before[d.id], predicted)
    return got, out
