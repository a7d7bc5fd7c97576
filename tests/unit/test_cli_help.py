"""The help text the `shardline` command hands its renderer: paragraphs, whatever the source's line width."""

from __future__ import annotations

from shardline.cli.help_text import as_paragraphs


def test_the_lines_of_a_paragraph_are_joined_and_paragraph_breaks_kept() -> None:
    docstring = """Score every row of the input shards.

        Exit codes: 0 all scored, 3 some
        shards quarantined, 1 failed (re-run to resume).
        """
    assert as_paragraphs(docstring) == ("Score every row of the input shards.\n\n"
                                        "Exit codes: 0 all scored, 3 some shards quarantined, 1 failed (re-run to resume).")
    assert as_paragraphs(as_paragraphs(docstring)) == as_paragraphs(docstring)


def test_literal_blocks_list_items_and_what_follows_form_feed_stay_as_written() -> None:
    docstring = """Run a job.

        For example:

            shardline batch run --model churn@prod \\
              --input in/ --output out/
        """
    assert as_paragraphs(docstring) == ("Run a job.\n\nFor example:\n\n"
                                        "    shardline batch run --model churn@prod \\\n      --input in/ --output out/")
    kept = "\bname     what\nchurn    a classifier"
    assert as_paragraphs(f"Models:\n\n{kept}") == f"Models:\n\n{kept}"
    listed = "Exit codes:\n- 0 all scored\n- 2 the request\nwas wrong"
    assert as_paragraphs(listed) == "Exit codes:\n- 0 all scored\n- 2 the request was wrong"
    assert as_paragraphs("Shown\nhere.\f\nnot shown\nhere") == "Shown here.\f\nnot shown\nhere"
