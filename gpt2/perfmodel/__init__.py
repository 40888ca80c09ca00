"""Analytical performance model of transformer training: step time and memory before running.

Build a ``ModelSpec``, a ``Workload`` (batch, sequence, precision) and a
``ParallelConfig``, load a ``HardwareProfile``, and call ``estimate``.  The CLI is
``python -m gpt2.perfmodel``; ``python -m gpt2.perfmodel.calibrate`` measures this
machine and writes its profile.
"""
from .collectives import all_gather, all_reduce, all_to_all, point_to_point, reduce_scatter
from .estimate import Estimate, estimate, op_time
from .graph import (GraphOptions, Op, binomial_recompute_steps, megatron_flops, mfu, model_flops_per_token,
                    palm_flops_per_token, step_graph)
from .hardware import EfficiencyCurve, HardwareProfile, Interconnect, available_profiles, load_profile, save_profile
from .memory import (MemoryBreakdown, activation_bytes, korthikanti_activations_per_layer, memory_breakdown,
                     model_state_bytes)
from .spec import ModelSpec, ParallelConfig, Workload

__all__ = ["EfficiencyCurve", "Estimate", "GraphOptions", "HardwareProfile", "Interconnect", "MemoryBreakdown",
           "ModelSpec", "Op", "ParallelConfig", "Workload", "activation_bytes", "all_gather", "all_reduce",
           "all_to_all", "available_profiles", "binomial_recompute_steps", "estimate", "korthikanti_activations_per_layer",
           "load_profile", "megatron_flops", "memory_breakdown", "mfu", "model_flops_per_token", "model_state_bytes",
           "op_time", "palm_flops_per_token", "point_to_point", "reduce_scatter", "save_profile", "step_graph"]
