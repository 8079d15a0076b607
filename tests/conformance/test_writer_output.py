"""What a writer adapter prints on success (UCP-1.0-R233, issue 27 point 15): nothing, or
one JSON object without ``error``; the writer suite fails any other output. And the fill
values it writes, spelled as UCP-1.0-R033 spells them (point 16; a warning otherwise)."""

from __future__ import annotations

import sys

from tests.conformance.conftest import adapter
from ucpformat.conformance.runner import writer_suite

# the reference adapter, followed by a line of text after a successful write
CHATTY = ("import runpy, sys\n"
          "try:\n"
          "    runpy.run_module('ucpformat.conformance.adapters.reference', run_name='__main__')\n"
          "except SystemExit as end:\n"
          "    if end.code == 0 and sys.argv[1] == 'write':\n"
          "        print('saved')\n"
          "    raise\n")


def test_text_on_success_fails_the_writer_suite() -> None:
    report = writer_suite(adapter(sys.executable, "-c", CHATTY), only=["basic"], faults=False)
    valid = report.by_check("writer.valid")
    assert valid and valid[0].status == "fail", report.render()
    assert any(f.rule == "UCP-1.0-R233" and "'saved'" in f.message for f in valid[0].findings)
    # the reference writer spells its fill values as R033 does: no warning
    assert not [f for f in valid[0].findings if f.rule == "UCP-1.0-R033"], valid[0].findings
