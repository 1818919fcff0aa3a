"""Tables through rich.table and sizes through rich.filesize stay plain, exact text."""

from __future__ import annotations

from lightning_roundpipe.cost.profile import format_bytes, format_count
from lightning_roundpipe.cost.text_table import render_table


def test_fixed_width_table_is_ascii_without_trailing_blanks_or_markup():
    text = render_table(("stage", "predicted", "notes"), [("F0", "1.2 ms", "[bold]x"), ("B12", "13.0 ms", "F 0:1 | B")],
                        right=(1,))
    assert text.splitlines() == ["stage  predicted  notes",
                                 "---------------------------",
                                 "F0        1.2 ms  [bold]x",
                                 "B12      13.0 ms  F 0:1 | B"]
    assert text.isascii()


def test_markdown_table_marks_right_columns_and_escapes_pipes():
    text = render_table(("schedule", "tokens/s", "notes"), [("gpipe", "1,234", "F 0:1 | B")], right=(1,),
                        markdown=True)
    assert text.splitlines() == ["| schedule | tokens/s | notes      |",
                                 "|----------|---------:|------------|",
                                 "| gpipe    |    1,234 | F 0:1 \\| B |"]


def test_formatters_print_as_before():
    assert [format_bytes(v) for v in (0, 1023, 1024, 1536, 999_999, 5e9, 3 * 2**40, -2048)] == [
        "0 B", "1023 B", "1.00 KiB", "1.50 KiB", "976.56 KiB", "4.66 GiB", "3.00 TiB", "-2.00 KiB"]
    assert [format_count(v) for v in (999, 999.6, 1000, 999_499, 999_500, 12_345_678, 9.996e3, 3.2e12)] == [
        "999", "999", "1.00K", "999K", "1.00M", "12.3M", "10.0K", "3200G"]
