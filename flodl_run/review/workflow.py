"""The GitHub Actions workflow a project copies to review configs in its pull requests
(`python -m flodl_run.review --print-workflow > .github/workflows/config-review.yml`).

Owns the workflow's text, nothing else; docs/pr-review.md shows the same text (a test keeps
them equal).
"""

SNAPSHOT_DIR = "conf_snapshots"

WORKFLOW = """\
# Config review on each pull request that touches conf/ or the snapshots:
# - one comment on the pull request, updated on each push: every named experiment whose
#   resolved config differs from the base branch's snapshot, field by field, and what the
#   change does to the run (global batch and learning rate, averaging, knobs that do nothing);
# - the job fails when a config changed and its snapshot did not: run
#   `.venv/bin/python -m flodl_run.review --update conf_snapshots` and commit the snapshots.
name: config review
on:
  pull_request:
    paths:
      - "conf/**"
      - "conf_snapshots/**"
permissions:
  contents: read
  pull-requests: write
jobs:
  review:
    runs-on: ubuntu-latest
    env:
      FLODL_RUN_CONF: ${{ github.workspace }}/conf
    steps:
      - uses: actions/checkout@v4
        with:
          fetch-depth: 0
      - uses: actions/setup-python@v5
        with:
          python-version: "3.11"
      # Review composes and validates, it trains nothing: a CPU-only torch from your own
      # index or mirror (pip's --extra-index-url) makes this step shorter.
      - name: Install
        run: |
          python3 -m venv .venv
          .venv/bin/pip install -e .
      - name: Diff against the base branch's snapshots
        env:
          BASE_REF: ${{ github.base_ref }}
        run: |
          base="$RUNNER_TEMP/base"
          mkdir -p "$base/conf_snapshots"
          git archive "origin/$BASE_REF" conf_snapshots | tar -x -C "$base" || true
          status=0
          .venv/bin/python -m flodl_run.review --check "$base/conf_snapshots" --format markdown \\
            > "$RUNNER_TEMP/review.md" || status=$?
          cat "$RUNNER_TEMP/review.md"
          # 1: configs differ from the base (what the comment shows); 2: a config is invalid.
          if [ "$status" -gt 1 ]; then exit "$status"; fi
      # A pull request from a fork gets a read-only token: the comment cannot be posted, the
      # review above is in the log, and the check below still decides.
      - name: Post or update the review comment
        continue-on-error: true
        env:
          GH_TOKEN: ${{ github.token }}
          PR: ${{ github.event.pull_request.number }}
        run: |
          marker="<!-- flodl_run config review -->"
          { echo "$marker"; echo "### Config review against the base branch"; echo;
            cat "$RUNNER_TEMP/review.md"; } > "$RUNNER_TEMP/comment.md"
          id=$(gh api "repos/$GITHUB_REPOSITORY/issues/$PR/comments" --paginate \\
            --jq ".[] | select(.body | startswith(\\"$marker\\")) | .id" | head -n 1)
          if [ -n "$id" ]; then
            gh api --method PATCH "repos/$GITHUB_REPOSITORY/issues/comments/$id" \\
              -F "body=@$RUNNER_TEMP/comment.md" > /dev/null
          else
            gh pr comment "$PR" --repo "$GITHUB_REPOSITORY" --body-file "$RUNNER_TEMP/comment.md"
          fi
      - name: Fail on a config change without its snapshot
        run: .venv/bin/python -m flodl_run.review --check conf_snapshots
"""
