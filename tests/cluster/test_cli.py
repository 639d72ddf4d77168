"""The ``vattn generate`` command, run in-process."""

from __future__ import annotations

import json

from cluster.cli import main


def test_generate_prints_json_per_prompt(capsys):
    code = main(["generate", "--prompt", "Hello", "--prompt", "abc", "--max-tokens", "4", "--kv-memory", "32MiB",
                 "--device", "cpu", "--json", "--ignore-eos"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "abc"]
    assert all(len(line["completions"][0]["token_ids"]) == 4 for line in lines)


def test_bad_argument_is_a_clear_error(capsys):
    assert main(["generate", "--prompt", "x", "--max-tokens", "0", "--device", "cpu"]) == 2
    assert "max_tokens must be an int > 0, got 0" in capsys.readouterr().err
