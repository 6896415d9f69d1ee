"""results.json -> the README's benchmark table, so no figure in the README is typed by hand.

Known benchmarks show their headline figures; any other benchmark shows its top-level scalar keys,
so a benchmark added to the suite appears in the table without touching this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"

# Headline keys of benchmarks whose figures are top-level scalars, in the order shown.
HEADLINES: dict[str, tuple[str, ...]] = {
    "refactorize": ("speedup", "max_rel_error_gap", "reference_seconds", "fedfleet_seconds"),
    "transport": (
        "fan_in_ratio",
        "fan_in_hashing_ratio",
        "fan_in_hash_bound_ratio",
        "fan_in_vs_hash_bound",
        "fan_in_fedfleet_mbps",
        "fan_in_raw_mbps",
        "mosquitto_ratio",
        "mosquitto_fedfleet_mbps",
        "mosquitto_raw_chunks_mbps",
        "mosquitto_vs_single",
        "amqtt_ratio",
    ),
    "costmodel": (
        "memory_rel_error_max",
        "time_ratio_rel_error_max",
        "held_out_time_ratio_rel_error_max",
    ),
    "poisoning": ("worst_drop_one_in_ten", "worst_drop_two_in_ten", "backdoor_success_one_in_ten"),
    "privacy": ("worst_gap_at_epsilon_8", "goal_met", "devices", "rounds", "seeds"),
    "secagg": (
        "bytes_ratio_fedavg_300",
        "bytes_ratio_fedhm_300",
        "server_seconds_fedavg_300",
        "plain_server_seconds_fedavg_300",
        "link_extra_bytes_per_device_fedavg_100",
        "link_bytes_ratio_fedhm_100",
        "link_extra_round_seconds_fedavg_100",
        "all_within_bound",
    ),
    "secagg_accuracy": (
        "fedavg_gap_points",
        "fedavg_plain_seed_std_points",
        "fedhm_gap_points",
        "fedhm_plain_seed_std_points",
        "seeds",
    ),
    "async": (
        "speedup_mean",
        "speedup_min",
        "goal_met",
        "target",
        "tta_sync_fedhm_s",
        "tta_async_fedhm_s",
        "tta_async_fedavg_s",
        "accuracy_same_time_sync_fedhm",
        "accuracy_same_time_async_fedhm",
        "accuracy_same_time_async_fedavg",
        "devices",
        "spread",
        "seeds",
    ),
}


class TableError(ValueError):
    """A results object or README that the table cannot be rendered from or into."""


def fmt(value: Any) -> str:
    """Numbers to 3 significant digits: enough to compare, few enough to read."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def scalars(result: dict[str, Any], keys: tuple[str, ...] | None = None) -> list[str]:
    """``key value`` for the given keys present in ``result``, else for every top-level scalar."""
    chosen = keys if keys is not None else tuple(result)
    return [
        f"`{key}` {fmt(result[key])}"
        for key in chosen
        if key != "benchmark" and isinstance(result.get(key), str | int | float | bool)
    ]


def _emulation(result: dict[str, Any]) -> list[str]:
    out = []
    if result.get("slowdown"):
        factors = "/".join(f"x{row['factor']}" for row in result["slowdown"])
        measured = "/".join(fmt(row["measured_vs_own_compute"]) for row in result["slowdown"])
        out.append(f"slowdown {factors} measured {measured}")
    if result.get("link"):
        out.append(
            "token bucket " + "/".join(fmt(row["measured_vs_configured"]) for row in result["link"]) + " of rate"
        )
    if result.get("memory"):
        out.append(
            "memory cap " + "/".join(fmt(row["largest_tensor_vs_budget"]) for row in result["memory"]) + " of budget"
        )
    for row in result.get("device_time", []):
        out.append(f"device time {row['device_class']}: emulated/predicted {fmt(row['emulated_vs_predicted'])}")
    return out


def _compare(result: dict[str, Any]) -> list[str]:
    """Final accuracy (mean over seeds) per scenario and strategy, each on its paper's metric; the claims' tally.

    A personalized method's figure is its personalized accuracy, marked ``(p)``: its global model is not
    what its paper measures.
    """
    metric = result.get("paper_metric", {})
    out = []
    for scenario, strategies in result.items():
        if not isinstance(strategies, dict) or scenario == "paper_metric":
            continue
        figures = []
        for name, row in strategies.items():
            key = metric.get(name, "accuracy")
            if isinstance(row, dict) and isinstance(row.get(key), dict):
                figures.append(f"{name} {fmt(row[key]['mean'])}{' (p)' if key == 'personalized_accuracy' else ''}")
        if figures:
            out.append(f"{scenario} accuracy: " + ", ".join(figures))
    checks = [c for c in result.get("checks", []) if isinstance(c, dict)]
    if checks:
        verdicts = [c.get("verdict") or ("PASS" if c.get("pass") else "FAIL") for c in checks]
        tally = ", ".join(f"{verdicts.count(v)} {v}" for v in ("PASS", "TIE", "FAIL") if v in verdicts)
        out.append(f"papers' claims: {tally}")
    # Each claim judged on a paired interval (since 2026-11-29): its verdict with the difference and 95 % CI.
    out += [
        f"{c['claim']} ({c['setting']}): {c['verdict']} {c['difference']:+.3f} "
        f"[{c['interval'][0]:+.3f}, {c['interval'][1]:+.3f}]"
        for c in checks
        if {"claim", "setting", "verdict", "difference"} <= c.keys() and isinstance(c.get("interval"), list)
    ]
    return out


def _fedlora(result: dict[str, Any]) -> list[str]:
    """The base's probe, each entry's accuracy (mean over seeds) and upload, and the paper's two checks."""
    out = [f"`probe_accuracy` {fmt(result.get('probe_accuracy'))} (pixels {fmt(result.get('pixel_probe_accuracy'))})"]
    for setting, rows in result.items():
        if setting.startswith("fedlora/") and isinstance(rows, dict):
            figures = [
                f"{name} {fmt(row['accuracy']['mean'])} ({row['upload_bytes_per_round'] / 1024:,.0f} KiB up)"
                for name, row in rows.items()
            ]
            out.append(f"{setting} accuracy: " + ", ".join(figures))
    checks = result.get("checks", {})
    # A claim is a verdict with its interval (recorded before that: a bool), base_transfers a bool.
    out += [
        f"{name}: {ok['verdict']} ({ok['detail']})" if isinstance(ok, dict) else f"{name}: {'PASS' if ok else 'FAIL'}"
        for name, ok in checks.items()
    ]
    return out


def _scale(result: dict[str, Any]) -> list[str]:
    out = [f"`max_devices` {result.get('max_devices')}"]
    for run in result.get("runs", []):
        learned = []
        if run.get("accepted_per_round"):
            learned.append(f"updates {'/'.join(str(n) for n in run['accepted_per_round'])}")
        if run.get("accuracy"):
            share = f", {run['train_images_per_device']} images/device" if "train_images_per_device" in run else ""
            px = f" at {run['image_size']} px" if "image_size" in run else ""
            learned.append(
                f"accuracy {'/'.join(fmt(a) for a in run['accuracy'])} on {run.get('dataset', 'digits')}{px}{share}"
            )
        out.append(
            f"{run['devices']} devices {'completed' if run['completed'] else 'missed'}: rounds "
            f"{'/'.join(fmt(s) for s in run['round_seconds'])} s (deadline {fmt(run['deadline_seconds'])} s, "
            f"slowest device predicted {fmt(run['slowest_predicted_round_seconds'])} s), "
            + "".join(f"{part}, " for part in learned)
            + f"coordinator {fmt(run['coordinator_rss_per_device_mib'])} MiB/device, "
            f"workers {fmt(run['workers_rss_per_device_mib'])} MiB/device"
            + (f", process tree peak {round(run['tree_peak_pss_mib'])} MiB PSS" if "tree_peak_pss_mib" in run else "")
        )
        if "flower" in run:
            flower = run["flower"]
            out.append(
                f"Flower {flower['flwr']} on the same task, {run['devices']} clients: rounds "
                f"{'/'.join(fmt(s) for s in flower['round_seconds'])} s, updates "
                f"{'/'.join(str(n) for n in flower['updates_per_round'])}, accuracy "
                f"{'/'.join(fmt(a) for a in flower['accuracy'])}, "
                f"process tree peak {round(flower['tree_peak_pss_mib'])} MiB PSS"
            )
    ratios = {key: value for key, value in result.items() if key.startswith("ratio_vs_flower_")}
    out += [f"`{key}` {fmt(value)} (fedfleet / Flower median round)" for key, value in ratios.items()]
    return out


def _process_peak(result: dict[str, Any]) -> list[str]:
    peak = result.get("process_peak", {})
    cases = [
        f"{row['arch']} b{row['batch_size']} gamma {fmt(row['gamma'])}: {fmt(row['predicted_vs_measured'])}"
        for row in peak.get("cases", [])
        if row.get("predicted_vs_measured")
    ]
    head = f"predicted/measured VmHWM worst error {fmt(peak.get('worst_error'))}"
    return [head + (f" ({', '.join(cases)})" if cases else "")]


def _faults(result: dict[str, Any]) -> list[str]:
    out = []
    scenarios = result.get("scenarios", {})
    if scenarios:
        survived = sum(bool(row["survived"]) for row in scenarios.values())
        lost = sum(row["lost_updates"] or 0 for row in scenarios.values())
        out.append(f"{survived}/{len(scenarios)} faults survived, {lost} updates lost")
    return out + _bad_inputs(result)


def _bad_inputs(result: dict[str, Any]) -> list[str]:
    kinds = result.get("bad_inputs", {})
    if not kinds:
        return []
    refused = sum(bool(row["refused"]) for row in kinds.values())
    unaffected = sum(bool(row["round_unaffected"]) for row in kinds.values())
    return [f"bad inputs refused {refused}/{len(kinds)}, round unaffected {unaffected}/{len(kinds)}"]


FIGURES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "emulation": _emulation,
    "compare": _compare,
    "compare_partial": _compare,
    "compare_5_seeds": _compare,
    "fedlora": _fedlora,
    "emulation_scale": _scale,
    "emulation_flower": _scale,
    "emulation_flower_fashion": _scale,
    "emulation_scale_cuda": _scale,
    "process_peak": _process_peak,
    "faults": _faults,
    "bad_inputs": _bad_inputs,
} | {name: (lambda result, keys=keys: scalars(result, keys)) for name, keys in HEADLINES.items()}


def machine_line(machine: dict[str, Any]) -> str:
    gpu = machine.get("gpu") or "no GPU"
    commit = machine.get("commit")
    source = f"commit {commit[:7]}{' (dirty)' if machine.get('dirty') else ''}" if commit else "commit not recorded"
    return (
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {fmt(machine.get('ram_gib', '?'))} GiB RAM, "
        f"torch {machine.get('torch', '?')}, {gpu}, {source}"
    )


def render(results: dict[str, Any]) -> str:
    """The markdown table (between the markers) for a results object as ``benchmarks.suite`` writes it."""
    entries = results.get("benchmarks")
    if not isinstance(entries, dict) or not entries:
        raise TableError("results have no 'benchmarks' object to render")
    rows = [
        BEGIN,
        "<!-- generated by `make bench` (benchmarks/table.py) from benchmarks/results.json: do not edit by hand -->",
        "",
        "| benchmark | command | figures | machine, device, date |",
        "|---|---|---|---|",
    ]
    for name, entry in entries.items():
        try:
            command, result, machine = entry["command"], entry["result"], entry["machine"]
        except (KeyError, TypeError):
            raise TableError(f"benchmark {name!r} lacks its command, result or machine") from None
        figures = FIGURES.get(name, scalars)(result) or ["(no scalar figures)"]
        where = f"{machine_line(machine)}; {entry.get('device', 'cpu')}; {entry.get('date', '?')}"
        rows.append(f"| {name} | `{command}` | {'; '.join(figures)} | {where} |")
    rows.append(END)
    return "\n".join(rows)


def replace_table(text: str, table: str) -> str:
    """``text`` with everything from the begin marker to the end marker replaced by ``table``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise TableError(f"the README has no {BEGIN} ... {END} markers to put the table between")
    return text[:start] + table + text[end + len(END) :]
