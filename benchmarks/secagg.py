"""Secure aggregation's price: SecAgg+ (device_agent.secagg) with 10, 100 and 300 devices in one process, against a
plain upload of the same update; and whole rounds over the round engine and the in-memory transport with 10 and
100 devices, secure against plain (``benchmarks.secagg_link``, ``link_*`` keys).

    python -m benchmarks.secagg [--json] [--devices 10,100,300] [--dropout 0,0.1] [--bits 16] [--link-devices 10,100]

Two uploads, both of the demo's CNN (``cnn``, 94,186 parameters): FedAvg's dense update, and FedHM's factors at
gamma 1/4 (25,066 values). FedHM averages the products A_i B_i, which are not a sum of what devices send, so
under SecAgg a FedHM device uploads its dense update masked: the row ``fedhm`` compares that masked dense upload
with the plain factor upload it replaces. Every message goes through its wire form (JSON header + raw bytes);
the plain upload is one float32 tensor in safetensors. ``dropout`` devices stop after sharing keys (before
masked input), which makes the coordinator rebuild their mask keys and remove their pairwise masks.

Per row: bytes per surviving device (up + down, all four exchanges) and at the coordinator, seconds of protocol code per
device (mean, max) and at the coordinator, the plain baseline's bytes and the coordinator's seconds to decode
and sum the plain uploads, and the largest error of the decoded sum against the float sum with its bound.
Devices and coordinator share one process and its cores, so seconds are CPU cost, not a fleet's wall time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

import numpy as np
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from benchmarks.machine import describe
from benchmarks.output import print_result
from benchmarks.secagg_link import measure_link, warm_up
from device_agent.layers.hybrid import hybrid
from device_agent.models import build_model
from device_agent.secagg.graph import suggested
from device_agent.secagg.local import InProcessRun
from device_agent.secagg.messages import Params, Session

ARCH = "cnn"
FEDHM_GAMMA = 0.25
CLIP = 0.05


def upload_sizes() -> dict[str, tuple[int, int]]:
    """{upload: (values a plain upload carries, values the masked upload carries)}."""
    dense = sum(t.numel() for t in build_model(ARCH).state_dict().values() if t.is_floating_point())
    factors = sum(t.numel() for t in hybrid(ARCH, FEDHM_GAMMA).state_dict().values() if t.is_floating_point())
    return {"fedavg": (dense, dense), "fedhm": (factors, dense)}


def plain_baseline(devices: int, values: int, rng: np.random.Generator) -> tuple[int, float]:
    """Bytes of one plain upload, and the coordinator's seconds to decode and sum ``devices`` of them."""
    uploads = [save_tensors({"update": rng.standard_normal(values, dtype=np.float32)}) for _ in range(devices)]
    started = time.perf_counter()
    total = np.zeros(values, dtype=np.float64)
    for upload in uploads:
        total += load_tensors(upload)["update"]
    return len(uploads[0]), time.perf_counter() - started


def measure(devices: int, upload: str, plain_values: int, masked_values: int, dropout: float, bits: int) -> dict:
    rng = np.random.default_rng(devices)
    threshold, neighbours = suggested(devices)
    names = tuple(f"dev-{i:04d}" for i in range(devices))
    params = Params(names, threshold=threshold, neighbours=neighbours, length=masked_values, clip=CLIP, bits=bits)
    inputs = {name: rng.uniform(-CLIP, CLIP, masked_values).astype(np.float32) for name in names}
    dropped = set(random.Random(devices).sample(names, round(dropout * devices)))
    keys = {name: name.encode().ljust(32, b"k") for name in names}
    run = InProcessRun(Session("bench", "secagg", 1), params, inputs, drop={"mask": dropped}, keys=keys)
    result = run.run()
    plain = np.sum([inputs[name].astype(np.float64) for name in result.survivors], axis=0)
    plain_bytes, plain_server_seconds = plain_baseline(devices, plain_values, rng)
    costs = run.costs
    # A device that went through all four exchanges (a dropped one stopped early and costs less).
    per_device = [costs.bytes_up[name] + costs.bytes_down[name] for name in result.survivors]
    device_seconds = [costs.device_seconds[name] for name in result.survivors]
    mean_bytes = statistics.fmean(per_device)
    return {
        "devices": devices,
        "upload": upload,
        "dropout": dropout,
        "threshold": threshold,
        "neighbours": neighbours,
        "modulus_bits": params.quantizer.modulus_bits,
        "values_plain": plain_values,
        "values_masked": masked_values,
        "plain_bytes_per_device": plain_bytes,
        "secure_bytes_per_device": round(mean_bytes),
        "secure_bytes_up_per_device": round(statistics.fmean(costs.bytes_up[name] for name in result.survivors)),
        "extra_bytes_per_device": round(mean_bytes - plain_bytes),
        "bytes_ratio": round(mean_bytes / plain_bytes, 3),
        "server_bytes_in": sum(costs.bytes_up.values()),
        "server_bytes_out": sum(costs.bytes_down.values()),
        "plain_server_bytes_in": plain_bytes * devices,
        "device_seconds_mean": round(statistics.fmean(device_seconds), 4),
        "device_seconds_max": round(max(device_seconds), 4),
        "server_seconds": round(costs.server_seconds, 3),
        "plain_server_seconds": round(plain_server_seconds, 4),
        "survivors": len(result.survivors),
        "max_abs_error": float(np.max(np.abs(result.total - plain))),
        "error_bound": result.error_bound,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--devices", default="10,100,300", help="comma-separated fleet sizes")
    parser.add_argument("--dropout", default="0,0.1", help="comma-separated fractions dropping before masked input")
    parser.add_argument("--bits", type=int, default=16, help="quantization bits per value")
    parser.add_argument(
        "--link-devices", default="10,100", help="fleet sizes of the rounds over the in-memory transport ('': none)"
    )
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.devices.split(",")]
    dropouts = [float(d) for d in args.dropout.split(",")]
    uploads = upload_sizes()
    rows = []
    for devices in sizes:
        for upload, (plain_values, masked_values) in uploads.items():
            for dropout in dropouts:
                rows.append(measure(devices, upload, plain_values, masked_values, dropout, args.bits))
                print(f"measured {devices} devices, {upload}, dropout {dropout}", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"benchmark": "secagg", "arch": ARCH, "fedhm_gamma": FEDHM_GAMMA, "bits": args.bits}
    for row in rows:
        if row["dropout"] == dropouts[0]:
            key = f"{row['upload']}_{row['devices']}"
            result[f"bytes_ratio_{key}"] = row["bytes_ratio"]
            result[f"server_seconds_{key}"] = row["server_seconds"]
            result[f"plain_server_seconds_{key}"] = row["plain_server_seconds"]
    result["all_within_bound"] = all(row["max_abs_error"] <= row["error_bound"] for row in rows)
    links = []
    if args.link_devices:
        warm_up()
    for devices in [int(n) for n in args.link_devices.split(",") if n]:  # smallest first
        for upload in uploads:
            links.append(measure_link(devices, upload))
            print(f"measured {devices} devices over the memory link, {upload}", file=sys.stderr, flush=True)
            key = f"{upload}_{devices}"
            result[f"link_bytes_ratio_{key}"] = links[-1]["bytes_ratio"]
            result[f"link_extra_bytes_per_device_{key}"] = links[-1]["extra_bytes_per_device"]
            result[f"link_extra_round_seconds_{key}"] = links[-1]["extra_round_seconds"]
    if links:
        result["link_all_accepted"] = all(row["all_accepted"] for row in links)
    result["rows"] = rows
    result["link_rows"] = links
    result["provenance"] = describe()
    print_result(result, args.json)
    return 0 if result["all_within_bound"] and result.get("link_all_accepted", True) else 1


if __name__ == "__main__":
    sys.exit(main())
