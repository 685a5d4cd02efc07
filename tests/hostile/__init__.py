"""Tests written from an outside attack.

Before an issue that adds or changes a public function, a file format or a CLI command is
resolved, a pass that reads only the docs and ../shared/HOSTILE.md (the attack classes) tries
to break the new surface; each finding becomes a test here that fails first, then passes.

One file per surface, named after it (``test_recorder.py``, ``test_top_examples_save.py``);
each test names its attack class from HOSTILE.md in its docstring. The attack and its
behaviour also get a row in docs/concepts/faults.md.
"""
