"""docs/keys.md is the generator's output, and the generator names every key."""

from pathlib import Path

from expertax.config import keys_doc
from expertax.config.schema import SECTIONS, Config, key_kind

ROOT = Path(__file__).resolve().parents[3]


def test_keys_doc_is_up_to_date():
    assert (ROOT / keys_doc.KEYS_DOC).read_text() == keys_doc.render(), (
        f"docs/keys.md differs from the schema: run `{keys_doc.REGENERATE}` from the repository "
        "root and commit the result"
    )


def test_every_key_has_one_row_with_its_kind_and_a_description():
    rows = [row for section in SECTIONS for row in keys_doc.key_rows(section)]
    names = [r[0] for r in rows]
    assert len(names) == len(set(names)) and set(names) == {f"`{k}`" for k in Config.model_fields}
    for name, _, _, kind, description in rows:
        assert kind == key_kind(name.strip("`")) and description, name


def test_type_and_default_cells():
    fields = Config.model_fields
    assert keys_doc.type_text(fields["vocab_size"]) == "int > 0"
    assert keys_doc.type_text(fields["attention_type"]) == "one of `gqa`, `mla`"
    assert keys_doc.type_text(fields["quantization"]).startswith('one of `""`, ')
    assert keys_doc.default_text(False) == "`false`"
    assert keys_doc.default_text("") == '`""`'


def test_check_fails_on_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "keys.md"
    stale.write_text(keys_doc.render().replace("`vocab_size`", "`vocab`"))
    assert keys_doc.main([str(stale), "--check"]) == 1
    assert keys_doc.REGENERATE in capsys.readouterr().err
    assert keys_doc.main([str(stale)]) == 0
    assert keys_doc.main([str(stale), "--check"]) == 0
