"""GPU specifications the planner carries the measured H200 step times with.

Every number is a vendor datasheet value (NVIDIA product pages and datasheets, listed in
``SOURCES``), per GPU, not measured here. Tensor-core rates are *dense* (the datasheets quote
2:4-sparse rates; those are halved). Memory is decimal GB as vendors state HBM. NVLink is the
per-GPU bidirectional rate; one direction is half of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gb: float  # HBM per GPU, decimal GB
    hbm_tbps: float  # HBM bandwidth, TB/s
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense
    nvlink_gbps: float  # per GPU, bidirectional, GB/s
    nvlink_domain: int  # GPUs one NVLink domain reaches (8: HGX board; 72: NVL72 rack)
    source: str

    @property
    def link_gbps_one_way(self) -> float:
        return self.nvlink_gbps / 2


SOURCES = {
    "H200": "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 / FP8 3,958 "
    "TFLOPS with sparsity, NVLink 900 GB/s)",
    "B200": "NVIDIA HGX B200 / DGX B200 datasheet (per GPU of 8: 180 GB HBM3e, 8 TB/s, BF16 4.5 / FP8 9 PFLOPS "
    "with sparsity, NVLink 5 1.8 TB/s)",
    "B300": "NVIDIA HGX B300 (Blackwell Ultra) datasheet (per GPU of 8: 288 GB HBM3e, 8 TB/s, BF16 4.5 / FP8 9 "
    "PFLOPS with sparsity, NVLink 5 1.8 TB/s)",
    "GB200": "NVIDIA GB200 NVL72 datasheet (rack of 72: 13.4 TB HBM3e, 576 TB/s, BF16 360 / FP8 720 PFLOPS with "
    "sparsity, NVLink 130 TB/s; divided by 72)",
    "GB300": "NVIDIA GB300 NVL72 datasheet (rack of 72: 20.7 TB HBM3e = 288 GB per GPU, 576 TB/s, BF16 360 / FP8 "
    "720 PFLOPS with sparsity, NVLink 130 TB/s; divided by 72)",
}

GPUS: dict[str, GPUSpec] = {
    "H200": GPUSpec("H200", 141.0, 4.8, 989.5, 1979.0, 900.0, 8, SOURCES["H200"]),
    "B200": GPUSpec("B200", 180.0, 8.0, 2250.0, 4500.0, 1800.0, 8, SOURCES["B200"]),
    "B300": GPUSpec("B300", 288.0, 8.0, 2250.0, 4500.0, 1800.0, 8, SOURCES["B300"]),
    "GB200": GPUSpec("GB200", 186.0, 8.0, 2500.0, 5000.0, 1800.0, 72, SOURCES["GB200"]),
    "GB300": GPUSpec("GB300", 288.0, 8.0, 2500.0, 5000.0, 1800.0, 72, SOURCES["GB300"]),
}
MEASURED_ON = "H200"  # every step time in bench/results was timed on this GPU


def gpu_spec(name: str) -> GPUSpec:
    try:
        return GPUS[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; expected one of {', '.join(GPUS)}") from None


def roofline_factor(bytes_ms: float, flops_ms: float, gpu: GPUSpec, base: GPUSpec | None = None) -> float:
    """How a step measured on ``base`` scales on ``gpu``: its floor is max(bytes term, FLOP term);
    each term scales by the datasheet ratio of its resource and the step keeps its fraction of the
    floor (the kernels stay as good, relative to the hardware, as they were on the H200)."""
    base = base or GPUS[MEASURED_ON]
    floor = max(bytes_ms, flops_ms)
    if floor <= 0:
        return base.hbm_tbps / gpu.hbm_tbps
    moved = max(bytes_ms * base.hbm_tbps / gpu.hbm_tbps, flops_ms * base.bf16_tflops / gpu.bf16_tflops)
    return moved / floor
