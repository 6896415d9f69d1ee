"""``report.html`` for a run directory: a summary table and four PNG plots, regenerated from files only.

The report reads nothing but the run directory (run.json, fleet.yaml, metrics.jsonl), so it can be
rebuilt at any time, on any machine, while a run is going or long after. The HTML has its style
inline and no scripts; its plots are PNG files next to it in ``plots/``.
"""

from __future__ import annotations

import html
import io
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path

import numpy as np
import yaml
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from coordinator.config.fleet import Fleet
from coordinator.run.metrics import DeviceRoundMetrics, RoundMetrics, failed_rounds
from coordinator.run.rundir import FLEET_FILE, METRICS_FILE, RUN_FILE, RunDirError, read_metrics, read_run_file
from device_agent.common.atomic import atomic_write
from export.records import TABLE_HEADER, read_exports, table_rows

REPORT_FILE = "report.html"
PLOTS_DIR = "plots"
_MIB = 2**20
DETAIL_DEVICES = 40
"""Up to this many devices the per-device plots give each device a labelled row; beyond it they draw a
fleet map (rank) or a bar per class (training time), whose cost does not grow with the fleet."""


class ReportError(Exception):
    """A run directory the report cannot be built from; the message names the file (and line)."""


def _ratio(value: float) -> str:
    return str(Fraction(value).limit_denominator(64))


def _mib(value: float) -> str:
    return f"{value / _MIB:.2f} MiB"


def _png(figure: Figure) -> bytes:
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _device_order(rounds: list[RoundMetrics]) -> list[tuple[str, str]]:
    """(device, class) pairs sorted by class then name, so devices of a class sit together."""
    classes = {name: device.device_class for row in rounds for name, device in row.devices.items()}
    return sorted(classes.items(), key=lambda item: (item[1], item[0]))


def plot_accuracy(rounds: list[RoundMetrics]) -> Figure:
    figure = Figure(figsize=(7, 3.6), layout="constrained")
    axes = figure.add_subplot()
    server = [(row.round, row.accuracy, row.loss) for row in rounds if row.accuracy is not None]
    federated = [
        (row.round, row.federated_accuracy, row.federated_loss) for row in rounds if row.federated_accuracy is not None
    ]
    if server:
        axes.plot(*list(zip(*server, strict=True))[:2], marker="o", color="tab:blue", label="accuracy")
    if federated:
        label = "federated accuracy (model received)"
        axes.plot(*list(zip(*federated, strict=True))[:2], marker="^", color="tab:purple", label=label)
    personalized = [(row.round, row.personalized_accuracy) for row in rounds if row.personalized_accuracy is not None]
    if personalized:
        axes.plot(*zip(*personalized, strict=True), marker="s", color="tab:green", label="devices' local accuracy")
    axes.set(xlabel="round", ylabel="global test accuracy", ylim=(0, 1), title="Accuracy vs round")
    axes.grid(alpha=0.3)
    loss = axes.twinx()
    losses = server or federated
    if losses:
        numbers, _, values = zip(*losses, strict=True)
        loss.plot(
            numbers, values, marker=".", color="tab:orange", alpha=0.7, label="loss" if server else "federated loss"
        )
    loss.set_ylabel("test loss")
    figure.legend(loc="outside lower center", ncols=3)
    return figure


def plot_bytes_per_class(rounds: list[RoundMetrics]) -> Figure:
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for row in rounds:
        for device in row.devices.values():
            entry = totals[device.device_class]
            entry[0] += device.bytes_up
            entry[1] += device.bytes_down
            entry[2] += device.payload_bytes
            entry[3] += 1
    classes = sorted(totals)
    figure = Figure(figsize=(7, 3.6), layout="constrained")
    axes = figure.add_subplot()
    positions = range(len(classes))
    up = [totals[c][0] / totals[c][3] / _MIB for c in classes]
    down = [totals[c][1] / totals[c][3] / _MIB for c in classes]
    axes.bar([p - 0.2 for p in positions], up, width=0.4, label="upload", color="tab:green")
    axes.bar([p + 0.2 for p in positions], down, width=0.4, label="download", color="tab:purple")
    for p, c in zip(positions, classes, strict=True):
        if totals[c][2]:
            axes.annotate(f"x{totals[c][0] / totals[c][2]:.3f}", (p - 0.2, up[p]), ha="center", va="bottom", size=8)
    axes.set_xticks(list(positions), classes)
    axes.set(ylabel="MiB per device per round", title="Bytes per device class (upload / payload ratio on top)")
    axes.legend()
    return figure


def _rows_height(devices: int) -> float:
    """Figure height for one row per device, capped at :data:`DETAIL_DEVICES` rows' worth."""
    return 1.6 + 0.28 * min(devices, DETAIL_DEVICES)


def _rank_markers(
    axes: Axes, rounds: list[RoundMetrics], devices: list[tuple[str, str]], colors: dict[float, str]
) -> None:
    """A marker per device and round, one collection per (ratio, accepted) pair."""
    points: dict[tuple[float, bool], tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for y, (name, _) in enumerate(devices):
        for row in rounds:
            device = row.devices.get(name)
            if device is not None:
                xs, ys = points[device.ratio, device.status == "accepted"]
                xs.append(row.round)
                ys.append(y)
    for (ratio, accepted), (xs, ys) in points.items():
        axes.scatter(xs, ys, s=60, marker="s" if accepted else "x", color=colors[ratio])
    numbers = [row.round for row in rounds]
    axes.set_xticks(numbers if len(numbers) <= 30 else numbers[:: math.ceil(len(numbers) / 30)])
    axes.set_yticks(range(len(devices)), [f"{name} ({cls})" for name, cls in devices], size=8)
    axes.set_ylim(len(devices) - 0.3, -0.7)


def _rank_map(axes: Axes, rounds: list[RoundMetrics], devices: list[tuple[str, str]], colors: dict[float, str]) -> None:
    """One image, a pixel row per device grouped by class: the drawing cost does not grow with the fleet."""
    rgba = {ratio: np.array(to_rgba(color)) for ratio, color in colors.items()}
    pale = {ratio: color * [0.35, 0.35, 0.35, 1] + [0.65, 0.65, 0.65, 0] for ratio, color in rgba.items()}
    image = np.zeros((len(devices), len(rounds), 4))
    index = {name: y for y, (name, _) in enumerate(devices)}
    for x, row in enumerate(rounds):
        for name, device in row.devices.items():
            image[index[name], x] = (rgba if device.status == "accepted" else pale)[device.ratio]
    axes.imshow(image, aspect="auto", interpolation="nearest", extent=(-0.5, len(rounds) - 0.5, len(devices), 0))
    ticks = range(0, len(rounds), math.ceil(len(rounds) / 30))
    axes.set_xticks(list(ticks), [str(rounds[x].round) for x in ticks])
    classes = Counter(cls for _, cls in devices)
    edges = np.cumsum([classes[cls] for cls in sorted(classes)])
    axes.hlines(edges[:-1], -0.5, len(rounds) - 0.5, color="black", linewidth=0.8)
    axes.set_yticks(edges - np.array([classes[cls] for cls in sorted(classes)]) / 2)
    axes.set_yticklabels([f"{cls} ({classes[cls]})" for cls in sorted(classes)], size=8)


def plot_rank_assignment(rounds: list[RoundMetrics]) -> Figure:
    """Each device's ratio in each round: labelled rows for a small fleet, a map grouped by class beyond."""
    devices = _device_order(rounds)
    figure = Figure(figsize=(7, _rows_height(len(devices))), layout="constrained")
    axes = figure.add_subplot()
    ratios = sorted({d.ratio for row in rounds for d in row.devices.values()}, reverse=True)
    colors = {ratio: f"C{index % 10}" for index, ratio in enumerate(ratios)}
    handles = [
        Line2D([], [], marker="s", linestyle="", color=colors[ratio], label=rf"$\gamma$ = {_ratio(ratio)}")
        for ratio in ratios
    ]
    if len(devices) <= DETAIL_DEVICES:
        _rank_markers(axes, rounds, devices, colors)
        handles.append(Line2D([], [], marker="x", linestyle="", color="grey", label="not accepted"))
    else:
        _rank_map(axes, rounds, devices, colors)
        handles.append(Line2D([], [], marker="s", linestyle="", color="0.8", label="not accepted (pale)"))
        handles.append(Line2D([], [], marker="s", linestyle="", color="black", fillstyle="none", label="not selected"))
        axes.set_ylabel(f"{len(devices)} devices, by class")
    figure.legend(handles=handles, loc="outside right upper")
    axes.set(xlabel="round", title="Rank ratio assigned to each device")
    axes.grid(alpha=0.2)
    return figure


def plot_time_breakdown(rounds: list[RoundMetrics]) -> Figure:
    phases = list(dict.fromkeys(phase for row in rounds for phase in row.phases))
    figure = Figure(figsize=(7, 3.6), layout="constrained")
    axes = figure.add_subplot()
    numbers = [row.round for row in rounds]
    bottom = [0.0] * len(rounds)
    for phase in [*phases, "other"]:
        if phase == "other":
            heights = [max(0.0, row.seconds - math.fsum(row.phases.values())) for row in rounds]
            if not any(heights):
                continue
        else:
            heights = [row.phases.get(phase, 0.0) for row in rounds]
        axes.bar(numbers, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axes.set(xlabel="round", ylabel="seconds", title="Round time breakdown")
    figure.legend(loc="outside right upper")
    return figure


def _mean_times(rounds: list[RoundMetrics], name: str) -> tuple[float, float | None] | None:
    """A device's mean training and host seconds over its accepted rounds; None if it has none."""
    accepted = [row.devices[name] for row in rounds if name in row.devices]
    train = [d.train_seconds for d in accepted if d.status == "accepted" and d.train_seconds is not None]
    if not train:
        return None
    hosts = [d.host_seconds for d in accepted if d.status == "accepted" and d.host_seconds is not None]
    return math.fsum(train) / len(train), math.fsum(hosts) / len(hosts) if hosts else None


def _bar_rows(devices: list[tuple[str, str]], detailed: bool) -> list[tuple[str, list[str]]]:
    """(label, devices) per bar: each device alone, or each class with its devices."""
    if detailed:
        return [(f"{name} ({cls})", [name]) for name, cls in devices]
    members: dict[str, list[str]] = defaultdict(list)
    for name, cls in devices:
        members[cls].append(name)
    return [(f"{cls} ({len(names)})", names) for cls, names in members.items()]


def plot_training_time(rounds: list[RoundMetrics]) -> Figure:
    """Mean training seconds per device as the device spends them; for an emulated device, the host's part too.

    Beyond :data:`DETAIL_DEVICES` devices, one bar per class (the mean of its devices, whiskers from
    the fastest to the slowest); the Devices table keeps each device's figure.
    """
    devices = _device_order(rounds)
    detailed = len(devices) <= DETAIL_DEVICES
    rows = _bar_rows(devices, detailed)
    figure = Figure(figsize=(7, _rows_height(len(rows))), layout="constrained")
    axes = figure.add_subplot()
    ys, means, spread, host_ys, host_means = [], [], [], [], []
    for y, (_, names) in enumerate(rows):
        times = [t for t in (_mean_times(rounds, name) for name in names) if t is not None]
        if not times:
            continue
        train = [t for t, _ in times]
        ys.append(y)
        means.append(math.fsum(train) / len(train))
        spread.append((means[-1] - min(train), max(train) - means[-1]))
        hosts = [h for _, h in times if h is not None]
        if hosts:
            host_ys.append(y)
            host_means.append(math.fsum(hosts) / len(hosts))
    whiskers = None if detailed or not spread else np.array(spread).T
    axes.barh(ys, means, xerr=whiskers, color="C0", capsize=3)
    axes.barh(host_ys, host_means, height=0.35, color="C1")
    handles = [Line2D([], [], color="C0", lw=8, label="device time"), Line2D([], [], color="C1", lw=4, label="host")]
    figure.legend(handles=handles, loc="outside right upper")
    axes.set_yticks(range(len(rows)), [label for label, _ in rows], size=8)
    if detailed:
        axes.set(xlabel="seconds per round (mean of accepted rounds)", title="Local training time per device")
    else:
        axes.set(
            xlabel="seconds per round (mean of accepted rounds; whiskers: fastest to slowest device)",
            title=f"Local training time per device class ({len(devices)} devices)",
        )
    axes.invert_yaxis()
    return figure


PLOTS = {
    "accuracy.png": ("Accuracy vs round", plot_accuracy),
    "bytes_per_class.png": ("Bytes per device class", plot_bytes_per_class),
    "rank_assignment.png": ("Rank assignment per device", plot_rank_assignment),
    "time_breakdown.png": ("Round time breakdown", plot_time_breakdown),
    "training_time.png": (
        "Local training time per device (device time; host part of emulated devices)",
        plot_training_time,
    ),
}

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.7em; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; display: block; margin: 1em 0; } pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
"""


def _table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    head = "".join(f"<th>{html.escape(str(cell))}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _accuracy_rows(rounds: list[RoundMetrics]) -> list[tuple[str, str]]:
    """Final and best accuracy: the server's when it evaluates, else the devices' federated evaluation."""
    last = rounds[-1]
    server = [row for row in rounds if row.accuracy is not None]
    federated = [row for row in rounds if row.federated_accuracy is not None]
    rows = []
    if server:
        best = max(server, key=lambda row: row.accuracy or 0.0)
        rows += [
            ("final accuracy", f"{_figure(last.accuracy)} (round {last.round})"),
            ("best accuracy", f"{_figure(best.accuracy)} (round {best.round})"),
            ("final loss", _figure(last.loss)),
        ]
    if federated:
        best = max(federated, key=lambda row: row.federated_accuracy or 0.0)
        rows += [
            ("final federated accuracy (model received)", f"{_figure(last.federated_accuracy)} (round {last.round})"),
            ("best federated accuracy", f"{_figure(best.federated_accuracy)} (round {best.round})"),
        ]
    return rows or [("accuracy", "not evaluated (no server evaluation, no device reported one)")]


def _summary(run: dict, rounds: list[RoundMetrics], quorum: float) -> str:
    devices = _device_order(rounds)
    up = sum(row.bytes_up for row in rounds)
    payload = sum(d.payload_bytes for row in rounds for d in row.devices.values() if d.status == "accepted")
    accepted_up = sum(d.bytes_up for row in rounds for d in row.devices.values() if d.status == "accepted")
    rows = [
        ("run", run["run_id"]),
        ("seed", run["seed"]),
        ("rounds completed", len(rounds)),
        ("failed rounds (below quorum)", ", ".join(map(str, failed_rounds(rounds, quorum))) or "none"),
        *_accuracy_rows(rounds),
        *(
            [("final local accuracy (mean of devices)", f"{rounds[-1].personalized_accuracy:.4f}")]
            if rounds[-1].personalized_accuracy is not None
            else []
        ),
        ("devices", f"{len(devices)} in {len({cls for _, cls in devices})} classes"),
        ("rank ratios", ", ".join(_ratio(r) for r in sorted({d.ratio for x in rounds for d in x.devices.values()}))),
        ("bytes up / down", f"{_mib(up)} / {_mib(sum(row.bytes_down for row in rounds))}"),
        ("upload / payload (accepted)", f"{accepted_up / payload:.4f}" if payload else "n/a"),
        ("total time", f"{sum(row.seconds for row in rounds):.1f} s"),
        *(
            [("privacy (user-level)", f"epsilon {p.epsilon:.3f} at delta {p.delta:g} after {len(rounds)} rounds")]
            if (p := rounds[-1].privacy) is not None
            else []
        ),
    ]
    return _table(("", "value"), rows)


def _per_device(rounds: list[RoundMetrics]) -> str:
    rows = []
    for name, cls in _device_order(rounds):
        seen = [row.devices[name] for row in rounds if name in row.devices]
        accepted = [d for d in seen if d.status == "accepted"]
        payload = sum(d.payload_bytes for d in accepted)
        train = [d.train_seconds for d in accepted if d.train_seconds is not None]
        rows.append(
            (
                name,
                cls,
                " ".join(sorted({_ratio(d.ratio) for d in seen}, key=lambda r: -float(Fraction(r)))),
                len(seen),
                len(accepted),
                ", ".join(sorted({d.status for d in seen} - {"accepted", "rejected"})) or "-",
                _refusals(seen),
                _share(sum(d.clipped is not None for d in accepted), len(seen)),
                _mib(sum(d.bytes_up for d in seen)),
                f"{sum(d.bytes_up for d in accepted) / payload:.4f}" if payload else "n/a",
                f"{sum(train) / len(train):.2f}" if train else "-",
                _longest_miss(seen),
            )
        )
    header = ("device", "class", "ratios", "selected", "accepted", "other outcomes", "refused", "clipped", "bytes up")
    header = (*header, "up / payload")
    return _table((*header, "mean train s", "most missed in a row"), rows)


def _share(count: int, of: int) -> str:
    return f"{count} ({count / of:.0%})" if count else "0"


def _refusals(seen: list[DeviceRoundMetrics]) -> str:
    """Refused updates with their share of the rounds the device was drawn into, and why: an honest device
    refused often is a gate tuned too tight for it (docs/robust-aggregation.md)."""
    reasons = Counter(d.reason or "other" for d in seen if d.status == "rejected")
    if not reasons:
        return "0"
    why = ", ".join(f"{reason} {n}" for reason, n in reasons.most_common())
    return f"{_share(sum(reasons.values()), len(seen))}: {why}"


def _longest_miss(seen: list[DeviceRoundMetrics]) -> int:
    """The most rounds in a row a device was drawn into and did not get an update accepted (its backoff's count)."""
    longest = streak = 0
    for device in seen:
        streak = 0 if device.status == "accepted" else streak + 1
        longest = max(longest, streak)
    return longest


def _sizes(row: RoundMetrics) -> tuple[str, str, str]:
    return _mib(row.bytes_up), _mib(row.bytes_down), f"{row.seconds:.1f}"


def _per_round(rounds: list[RoundMetrics]) -> str:
    rows = [
        (
            row.round,
            _figure(row.accuracy),
            _figure(row.loss),
            _figure(row.federated_accuracy),
            row.participants,
            len(row.devices),
            *_sizes(row),
        )
        for row in rounds
    ]
    header = ("round", "accuracy", "loss", "federated accuracy", "participants", "selected", "up", "down", "seconds")
    if any(row.privacy is not None for row in rounds):
        header = (*header, "epsilon", "clip norm")
        rows = [(*cells, *_privacy_cells(row)) for cells, row in zip(rows, rounds, strict=True)]
    if any(row.asynchronous is not None for row in rounds):
        header = ("version", *header[1:], "updates", "staleness (s:updates)", "too stale")
        rows = [(*cells, *_async_cells(row)) for cells, row in zip(rows, rounds, strict=True)]
    return _table(header, rows)


def _async_cells(row: RoundMetrics) -> tuple[str, str, str]:
    """Async mode (docs/async.md): the updates a version folded, their staleness, and the too-stale refused."""
    a = row.asynchronous
    if a is None:
        return ("-", "-", "-")
    return (str(a.updates), " ".join(f"{s}:{n}" for s, n in sorted(a.staleness.items())), str(a.too_stale))


def _staleness(rounds: list[RoundMetrics]) -> str:
    """Async mode: the run's staleness histogram over its published versions (empty in rounds)."""
    versions = [row.asynchronous for row in rounds if row.asynchronous is not None]
    if not versions:
        return ""
    histogram: Counter[int] = Counter()
    for version in versions:
        histogram.update(version.staleness)
    total = sum(histogram.values())
    rows = [
        (s, n, f"{n / total:.1%}", "#" * max(1, round(40 * n / max(histogram.values()))))
        for s, n in sorted(histogram.items())
    ]
    refused = sum(v.too_stale for v in versions)
    updates = [v.updates for v in versions]
    caption = (
        f"<p>{len(versions)} model versions, {total} updates folded ({min(updates)}-{max(updates)} a version), "
        f"{refused} refused as too stale. Staleness: versions published while the update trained.</p>"
    )
    return f"<h2>Staleness (async)</h2>{caption}{_table(('staleness', 'updates', 'share', ''), rows)}"


def _privacy_cells(row: RoundMetrics) -> tuple[str, str]:
    """epsilon at delta after the round, and the clip norm for the next (docs/privacy.md)."""
    if row.privacy is None:
        return ("-", "-")
    return (f"{row.privacy.epsilon:.3f} (delta {row.privacy.delta:g})", f"{row.privacy.clip_norm:.4g}")


def load_run(run_dir: Path) -> tuple[dict, list[RoundMetrics]]:
    """run.json and the validated rounds, or a :class:`ReportError` naming what is wrong."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist")
    if not any(run_dir.iterdir()):
        raise ReportError(f"run directory {run_dir} is empty: no run has started there")
    try:
        run = read_run_file(run_dir / RUN_FILE)
        metrics = run_dir / METRICS_FILE
        rounds = read_metrics(metrics) if metrics.exists() else []
    except RunDirError as exc:
        raise ReportError(str(exc)) from None
    if not rounds:
        raise ReportError(f"{run_dir / METRICS_FILE} has no completed round yet: nothing to report")
    return run, rounds


def _exports(run_dir: Path) -> str:
    """The files ``coordinator export`` wrote from this run, with size, parity and latency."""
    records = read_exports(run_dir)
    return f"<h2>Exported models</h2>{_table(TABLE_HEADER, table_rows(records))}" if records else ""


DEFAULT_QUORUM: float = Fleet.model_fields["quorum"].default


def _quorum(fleet_file: Path) -> float:
    """The run's quorum from its fleet.yaml snapshot; the default when the snapshot is gone or unreadable."""
    try:
        raw = yaml.safe_load(fleet_file.read_text()) if fleet_file.exists() else None
        return float(raw.get("quorum", DEFAULT_QUORUM)) if isinstance(raw, dict) else DEFAULT_QUORUM
    except (OSError, yaml.YAMLError, TypeError, ValueError):
        return DEFAULT_QUORUM


def write_report(run_dir: Path) -> Path:
    """(Re)write ``report.html`` and ``plots/*.png`` in ``run_dir``; returns the report's path."""
    run_dir = Path(run_dir)
    run, rounds = load_run(run_dir)
    (run_dir / PLOTS_DIR).mkdir(exist_ok=True)
    figures = []
    for name, (title, plot) in PLOTS.items():
        atomic_write(run_dir / PLOTS_DIR / name, _png(plot(rounds)))
        figures.append(f'<h2>{html.escape(title)}</h2><img src="{PLOTS_DIR}/{name}" alt="{html.escape(title)}">')
    fleet = run_dir / FLEET_FILE
    snapshot = html.escape(fleet.read_text()) if fleet.exists() else "(no snapshot)"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fedfleet run {html.escape(run["run_id"])}</title>
<style>{_STYLE}</style></head><body>
<h1>fedfleet run {html.escape(run["run_id"])}</h1>
<h2>Summary</h2>{_summary(run, rounds, _quorum(fleet))}
{"".join(figures)}
<h2>Devices</h2>{_per_device(rounds)}
<h2>Rounds</h2>{_per_round(rounds)}
{_staleness(rounds)}
{_exports(run_dir)}
<h2>Configuration</h2><details><summary>{FLEET_FILE} snapshot</summary><pre>{snapshot}</pre></details>
</body></html>
"""
    report = run_dir / REPORT_FILE
    atomic_write(report, page.encode())
    return report
