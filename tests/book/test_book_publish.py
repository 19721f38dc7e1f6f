"""Publishing: the GitHub Pages workflow builds the book with the README's own
command and deploys _build/html the way Jupyter Book documents; the repository's
address is set in one place; no launch button points at a placeholder."""
from __future__ import annotations

import re

import yaml

import docpages
from course import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"


def readme_build_command():
    """The install-and-build command of the README's first shell block, without its comment."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1)
    line = next(l for l in block.splitlines() if "jupyter-book build" in l)
    return line.split("#", 1)[0].strip()


def workflow():
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.get("on", data.get(True))  # YAML 1.1 reads a bare `on` as true
    return data


def steps():
    (job,) = workflow()["jobs"].values()
    return job, job["steps"]


def test_workflow_runs_the_readmes_command():
    command = readme_build_command()
    assert command == "pip install -r requirements.txt && jupyter-book build ."
    _, all_steps = steps()
    runs = [s["run"].strip() for s in all_steps if "run" in s]
    assert command in runs, f"no step runs the README's command {command!r}: {runs}"


def test_workflow_is_the_documented_pages_deployment():
    data = workflow()
    assert "main" in data["on"]["push"]["branches"]
    assert data["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}
    job, all_steps = steps()
    assert job["environment"]["name"] == "github-pages"
    uses = [s.get("uses", "").split("@")[0] for s in all_steps]
    order = ["actions/checkout", "actions/setup-python", "actions/upload-pages-artifact", "actions/deploy-pages"]
    assert [u for u in uses if u in order] == order, uses
    build = next(i for i, s in enumerate(all_steps) if s.get("run", "").strip() == readme_build_command())
    upload = uses.index("actions/upload-pages-artifact")
    assert build < upload and all_steps[upload]["with"]["path"] == "_build/html"
    python = next(s for s in all_steps if s.get("uses", "").startswith("actions/setup-python"))
    assert str(python["with"]["python-version"]) == "3.11"  # the README's Python


def test_repository_address_is_set_in_one_place():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    url = config["repository"]["url"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), url
    for path in [WORKFLOW, ROOT / "_toc.yml", *(ROOT / "chapters").glob("*.md"), ROOT / "intro.md"]:
        assert url not in path.read_text(), f"{path.relative_to(ROOT)} repeats the repository's address"
    assert "repository.url" in WORKFLOW.read_text()  # the workflow checks it against its own repository


def test_no_launch_button_points_at_a_placeholder():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    buttons = config["launch_buttons"]
    assert not buttons.get("jupyterhub_url"), "the JupyterHub button is on, with a placeholder address"
    for key, value in buttons.items():
        assert "example" not in str(value), f"launch_buttons.{key} = {value}"
    assert "jupyterhub_url" in docpages.section("### Launch buttons")  # how to turn it on is documented
