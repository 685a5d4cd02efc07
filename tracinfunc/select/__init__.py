"""Selecting training data by influence (LESS) and the ranked examples it returns."""

from tracinfunc.select.less import DataSelection, less_scores, select_training_data
from tracinfunc.select.top_examples import TopExamples

__all__ = [
    "DataSelection",
    "TopExamples",
    "less_scores",
    "select_training_data",
]
