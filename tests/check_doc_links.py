"""Checks the relative links of the project's Markdown files (README.md, docs/, ...): each must
name a file or folder inside the repository that exists. A link that leaves the repository (the
project points at nothing outside it) or names a missing file fails, with its file and line.
Web links (http, https, mailto) and in-page anchors are not checked; a link's own #anchor is cut
off before the check. Then every mention of a page as `docs/<page>.md` in the tracked sources,
scripts and pages (comments and prose, where a page that was split or renamed leaves a stale
pointer) must name a page that exists.

ctest runs it as docs.links (tests/CMakeLists.txt). Usage: check_doc_links.py REPOSITORY_ROOT
"""
import os
import re
import subprocess
import sys

# [text](target) and [text](target "title"); images too (![alt](target)).
LINK = re.compile(r"\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
SKIP = ("http://", "https://", "mailto:", "#")
DOC_MENTION = re.compile(r"(?<![\w/.-])docs/[\w-]+(?:/[\w-]+)*\.md\b")
MENTION_FILES = ("*.md", "*.h", "*.cpp", "*.cu", "*.cuh", "*.py", "*.txt", "*.cmake", "scripts/*",
                 ".ci/*")


def markdown_files(root):
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=root, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return [os.path.join(root, p) for p in listed.stdout.split()]
    # Not a git checkout (an exported tree): walk it, leaving build output and environments out.
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.startswith("build")]
        found += [os.path.join(folder, f) for f in files if f.endswith(".md")]
    return found


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: check_doc_links.py REPOSITORY_ROOT")
    root = os.path.realpath(sys.argv[1])
    problems, checked = [], 0
    for path in sorted(markdown_files(root)):
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        in_code = False
        for number, line in enumerate(lines, start=1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(line):
                if target.startswith(SKIP):
                    continue
                checked += 1
                file_part = target.split("#", 1)[0]
                resolved = os.path.realpath(os.path.join(os.path.dirname(path), file_part))
                where = f"{os.path.relpath(path, root)}:{number}: '{target}'"
                if os.path.commonpath([resolved, root]) != root:
                    problems.append(f"{where} points outside the repository")
                elif not os.path.exists(resolved):
                    problems.append(f"{where} names {os.path.relpath(resolved, root)}, which "
                                    "does not exist")
    mentions = 0
    listed = subprocess.run(["git", "ls-files", *MENTION_FILES], cwd=root, capture_output=True,
                            text=True)
    for relative in listed.stdout.split():
        try:
            with open(os.path.join(root, relative), encoding="utf-8") as f:
                lines = f.read().split("\n")
        except (OSError, UnicodeDecodeError):
            continue
        for number, line in enumerate(lines, start=1):
            for page in DOC_MENTION.findall(line):
                mentions += 1
                if not os.path.exists(os.path.join(root, page)):
                    problems.append(f"{relative}:{number}: mentions {page}, which does not exist")
    for p in problems:
        print(p)
    print(f"{checked} relative links and {mentions} mentions of docs/ pages checked, "
          f"{len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
