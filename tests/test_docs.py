"""The README and the docs/ pages link only to what exists: every relative link names an existing file, and
a ``#heading`` in it names a heading of that Markdown file (GitHub's anchors); the pages' parts written by
docs/generate.py are current, their activations are the code's, and layout.md's inner-model example works."""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest
from helpers.train import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)  # [label]: target
FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+).*?\1", re.DOTALL)


def pages(root: Path = REPO) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def links(text: str) -> list[str]:
    """The link targets of Markdown ``text``, code blocks and code spans left out."""
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    return LINK.findall(prose) + REFERENCE.findall(prose)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link's text only
    kept = (c for c in text if c.isalnum() or c in "-_ " or unicodedata.category(c).startswith("M"))
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (a repeated heading's with GitHub's ``-1``, ``-2``, ...
    suffixes)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that do not resolve, each as ``target (why)``."""
    bad = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:, ...: not a file here
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    assert page.is_file()
    assert broken_links(page) == [], f"{page.relative_to(REPO)}: broken links"


def test_the_check_finds_a_broken_file_link_and_a_broken_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Page A\n\n## Its `part`: two\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# T\n\n[a](docs/a.md) [part](docs/a.md#its-part-two) [self](#t) [web](https://example.org/x)\n"
        "[gone](docs/gone.md) [no heading](docs/a.md#nowhere) `[code](docs/code.md)`\n\n"
        "```\n[fenced](docs/fenced.md)\n```\n\n[ref]: docs/missing.md\n",
        encoding="utf-8",
    )
    assert broken_links(readme) == [
        "docs/gone.md (no such file)",
        "docs/a.md#nowhere (no heading #nowhere in a.md)",
        "docs/missing.md (no such file)",
    ]
    assert pages(tmp_path) == [readme, tmp_path / "docs" / "a.md"]


def generator():
    """``docs/generate.py``, the script that writes the docs' generated parts, imported from its file."""
    spec = importlib.util.spec_from_file_location("docs_generate", REPO / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_parts_of_the_docs_are_current():
    stale = generator().stale_pages()
    assert not stale, f"{[str(p) for p in stale]}: not the registry's; run `python docs/generate.py`"


def test_the_inner_model_table_follows_the_registry(registry, tmp_path):
    """A model registered after the page was written makes it stale; the rewrite adds its row, a model
    without a formula is refused by name, markers out of order too, and a formula with a ``|`` at its
    registration."""
    from vit3.layers import inner_models
    from vit3.layers.inner_models import LinearInner, register_inner_model

    gen = generator()
    (tmp_path / "mixer.md").write_text((REPO / "docs" / "mixer.md").read_text())
    assert gen.stale_pages(tmp_path) == {}
    register_inner_model("gate", formula="k ⊙ w")(LinearInner)
    stale = gen.stale_pages(tmp_path)
    assert list(stale) == [tmp_path / "mixer.md"]
    assert "| `gate` | k ⊙ w | yes |  |" in stale[tmp_path / "mixer.md"].splitlines()
    del inner_models._REGISTRY["gate"]
    register_inner_model("gate")(LinearInner)
    with pytest.raises(ValueError, match="inner model 'gate' has no formula"):
        gen.inner_model_table()
    swapped = tmp_path / "swapped.md"
    swapped.write_text(f"{gen.END}\n{gen.BEGIN}\n")
    with pytest.raises(ValueError, match="after it the line"):
        gen.written(swapped)
    with pytest.raises(ValueError, match="its formula is a table cell"):
        register_inner_model("gate_abs", formula="|k W|")


def test_the_mixer_page_names_every_activation_of_the_inner_models():
    from vit3.layers.inner_math import ACTIVATIONS

    row = next(line for line in (REPO / "docs" / "mixer.md").read_text().splitlines()
               if line.startswith("| `mlp_ratio`, `mlp_act`"))  # fmt: skip
    named = set(re.findall(r"`(\w+)`", row.split("|")[3].split(";")[1]))
    assert named == set(ACTIVATIONS)


def test_the_inner_model_example_of_the_checklist_is_a_working_model(registry):
    """The complete example of docs/layout.md's "Adding an inner model", run as written in
    ``vit3.layers.inner_models``' namespace: it registers, its ``grads`` (from the cache of
    ``need_output=False`` too) are autograd's of its own forward, and a mixer built with it equals the
    reference mixer, where the model stands for itself (no line of its own in ``helpers.reference``). A model
    of the example's name registered by the package (one added by following the guide) stays out of the
    test's copy of the registry."""
    import torch
    from helpers.reference import assert_mixer_matches_reference

    from vit3.layers import TTTMixer, inner_models
    from vit3.layers.config import INNER_MODELS

    text = (REPO / "docs" / "layout.md").read_text()
    section = text.split("## Adding an inner model", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    inner_models._REGISTRY.pop(re.search(r'register_inner_model\("(\w+)"', code)[1], None)
    before = set(INNER_MODELS)
    exec(code, dict(vars(inner_models)))
    (name,) = set(INNER_MODELS) - before
    cls = inner_models._REGISTRY[name].cls
    model = cls(3, 8).double()
    g = torch.Generator().manual_seed(0)
    p = {n: (w.detach().expand(2, *w.shape[1:]) + 0.1 * torch.randn(2, *w.shape[1:], generator=g,
             dtype=torch.float64)).requires_grad_() for n, w in model.initial_params().items()}  # fmt: skip
    k, e = (torch.randn(2, 3, 20, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, _ = model.forward_train(p, k, (4, 5), need_output=True)
    expected = torch.autograd.grad((out * e).sum(), list(p.values()))
    _, cache = model.forward_train(p, k, (4, 5), need_output=False)
    got = model.grads(p, k, e, cache, (4, 5))
    for n, want in zip(p, expected):
        torch.testing.assert_close(got[n], want, rtol=1e-12, atol=1e-12)
    mixer = TTTMixer(32, 4, branches=(name, "dwconv:1")).double()
    assert isinstance(mixer.inner[0], cls)
    x = torch.randn(2, 20, 32, dtype=torch.float64, requires_grad=True)
    assert_mixer_matches_reference(mixer, x, (4, 5))
