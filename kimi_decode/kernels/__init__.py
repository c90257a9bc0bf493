"""CuTe DSL kernels of the fused decode path (one kernel per module, see STYLE.md).

Every kernel targets sm_90a (H200). On a machine without a GPU the DSL still traces and
compiles them to PTX, which the CPU test suite does; launching needs the GPU. The compile
target is fixed here, before `cutlass` is imported, because without a GPU the DSL would
otherwise default to sm_100a.
"""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
