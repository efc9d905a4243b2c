"""Roofline analysis (issue 3): FLOPs, bytes and roofline time of every operator of a step.

Public API (the CLI is ``ridge analyze``, see ``ridge.roofline.cli``):
- ``ModelShape.from_preset(name)`` / ``ModelShape.from_hf_config(config_dict)`` /
  ``load_model_shape(preset_or_path)``: what the costs depend on; ``load_model`` adds a GGUF
  file's weights by format (``Precision.for_weight_mix`` prices them).
- ``step_cost(model, prefill_chunks, decode_context_lens, weight_bytes_per_param,
  kv_bytes_per_elem, act_bytes)``: one engine step, per operator (the single cost model).
- ``HARDWARE_PRESETS`` / ``resolve_hardware(name)``: peaks and bandwidths with sources;
  ``local`` is measured by ``ridge.roofline.probe`` (imports torch, so it is not re-exported).
- ``analyze(model, hardware, Workload(...), Conventions(...))``: phases, sweeps, summary.
"""

from ridge.roofline.analyze import Analysis, Conventions, Workload, analyze
from ridge.roofline.hardware import HARDWARE_PRESETS, Hardware, resolve_hardware
from ridge.roofline.ops import (
    CostConventions,
    OpCost,
    Precision,
    StepCost,
    matmul_cost,
    step_cost,
    step_cost_from_counts,
)
from ridge.roofline.shapes import ModelShape, load_model, load_model_shape

__all__ = [
    "Analysis",
    "Conventions",
    "CostConventions",
    "HARDWARE_PRESETS",
    "Hardware",
    "ModelShape",
    "OpCost",
    "Precision",
    "StepCost",
    "Workload",
    "analyze",
    "load_model",
    "load_model_shape",
    "matmul_cost",
    "resolve_hardware",
    "step_cost",
    "step_cost_from_counts",
]
