"""Convergence studies: observed orders in the depth step and in the resolution."""

from ._depth import format_table, run_depth_study, write_outputs
from ._grid import run_grid_study
from ._model import format_model_study, model_depth_study, write_model_study

__all__ = [
    "format_model_study",
    "format_table",
    "model_depth_study",
    "run_depth_study",
    "run_grid_study",
    "write_model_study",
    "write_outputs",
]
