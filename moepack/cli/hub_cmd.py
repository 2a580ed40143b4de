"""`moepack publish` and `moepack pull`: the Hugging Face hub."""

from __future__ import annotations

import click


@click.command("publish")
@click.argument("packed", type=click.Path(file_okay=False))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo private (only applies when it is created).")
@click.option("--revision", default=None, metavar="BRANCH",
              help="Branch to commit to (created from main when missing). Default: main.")
@click.option("--commit-message", default=None, metavar="M", help="Commit message (default: model type, bits, "
              "moepack version). The manifest + card commit gets ' (manifest and model card)' appended.")
@click.option("--dry-run", is_flag=True, help="Verify, then print the file list with sizes and the model card; "
              "upload nothing, write nothing.")
def publish_cmd(packed, repo_id, private, revision, commit_message, dry_run):
    """Upload a packed model to the Hugging Face hub, with a generated model card.

    The folder must pass `moepack verify` (problems are named and nothing is uploaded). The model card
    (README.md in PACKED) is regenerated from the manifest: format, bits per layer, RMSE table, quality figures,
    bytes read per token, usage; your own text outside its <!-- moepack:begin/end --> markers is kept. Then the
    repo is created if needed and the data uploaded, the manifest and card last. An interrupted upload resumes
    when the same command is run again.

    The token comes from HF_TOKEN or the hub's saved login (`hf auth login`); it is never printed.

    \b
    Examples:
      moepack publish ./q397-2bit me/Qwen3.5-397B-A17B-moepack-2bit --dry-run
      moepack publish ./q397-2bit me/Qwen3.5-397B-A17B-moepack-2bit --private
      moepack publish ./q397-2bit my-org/q397-2bit --revision layers0-2-at-4bit \\
          --commit-message "2-bit experts, layers 0-2 at 4-bit"
    """
    from ..hub.publish import check_token, find_token, prepare_publish, require_token, upload
    from .tables import human_bytes

    if dry_run:
        plan = prepare_publish(packed, repo_id, revision=revision, private=private, commit_message=commit_message)
        _, where = find_token()
        _print_plan(plan, where, human_bytes)
        return
    token, where = require_token()
    check_token(token, where)
    plan = prepare_publish(packed, repo_id, revision=revision, private=private, commit_message=commit_message)
    click.echo(f"verified: {plan.checked_files} files, {plan.checked_records} expert records", err=True)
    res = upload(plan, token=token)
    for note in res.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"card: {plan.packed / 'README.md'}")
    click.echo(f"uploaded: {res.files} files, {human_bytes(res.bytes)} to {res.url}"
               + (f" (commit {res.commit[:12]})" if res.commit else ""))
    click.echo(f"pull it with: moepack pull {res.repo_id}" + (f" --revision {res.revision}"
                                                               if res.revision != "main" else ""))


def _print_plan(plan, token_where, human_bytes) -> None:
    branch = plan.revision or "main"
    vis = "private" if plan.private else "public unless your namespace defaults to private"
    click.echo("dry run: nothing is uploaded and nothing is written")
    click.echo(f"repo      {plan.repo_id} (branch {branch}; if created: {vis})")
    click.echo("token     " + (f"found ({token_where})" if token_where
                              else "none: run `hf auth login` (or set HF_TOKEN) before publishing"))
    click.echo(f"verified  {plan.checked_files} files, {plan.checked_records} expert records")
    click.echo(f"license   {plan.license or 'unknown (add `license:` to the card front matter)'}")
    click.echo(f"files     {len(plan.files)} files, {human_bytes(plan.total_bytes)}, in 2 commits:")
    width = max(len(f"{s:,}") for _, s in plan.files)
    for title, files in ((plan.commit_message, plan.data_files), (plan.meta_message, plan.meta_files)):
        click.echo(f"  commit: {title}")
        for name, size in files:
            note = "  (model card, generated)" if name == "README.md" else ""
            click.echo(f"    {size:>{width},}  {name}{note}")
    click.echo("--- README.md " + "-" * 60)
    click.echo(plan.card.rstrip("\n"))
    click.echo("-" * 74)


@click.command("pull")
@click.argument("repo_id")
@click.option("--revision", default=None, metavar="R", help="Branch, tag or commit (default: main).")
@click.option("--local-dir", type=click.Path(file_okay=False), default=None, metavar="D",
              help="Download into this folder instead of the Hugging Face cache.")
def pull_cmd(repo_id, revision, local_dir):
    """Download a packed model from the Hugging Face hub and verify it once, before first use.

    Files go to the hub cache (or --local-dir), with progress and resume. Every file's size and checksum and
    every expert record's checksum are then checked; the result is remembered (.moepack-verified next to the
    manifest) so later runs do not repeat it. Works offline from the cache with HF_HUB_OFFLINE=1. A copy that
    fails the check is not left looking complete: the damaged files and the manifest are removed.

    Prints the model's folder on stdout (messages go to stderr), so `moepack inspect "$(moepack pull ...)"` works.

    \b
    Examples:
      moepack pull me/Qwen3.5-397B-A17B-moepack-2bit
      moepack pull me/Qwen3.5-397B-A17B-moepack-2bit --revision v2 --local-dir ./q397-2bit
      HF_HUB_OFFLINE=1 moepack pull me/Qwen3.5-397B-A17B-moepack-2bit
    """
    from ..hub.pull import pull

    res = pull(repo_id, revision=revision, local_dir=local_dir)
    at = f"{res.repo_id}@{res.commit[:12]}" if res.commit else res.repo_id
    if res.verified_now:
        click.echo(f"verified {at}: {res.checked_files} files, {res.checked_records} expert records", err=True)
    else:
        click.echo(f"{at}: verified earlier ({res.verified_at or 'date unknown'}); sizes unchanged", err=True)
    click.echo(str(res.path))
