"""A report a person opens: one self-contained HTML page of queries and their influences."""

from tracinfunc.report.write import write_report

__all__ = ["write_report"]
