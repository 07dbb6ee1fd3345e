"""Checks the pointers between the project's pages and from its sources to them:

  - every relative Markdown link ([text](target), images too) in a tracked .md file must name a
    file or folder inside the repository that exists (the project points at nothing outside
    it); web links (http, https, mailto) and in-page anchors are not checked, a link's own
    #anchor is cut off first, and code blocks and `code spans` are skipped. Reference-style
    links ([text]: target) and HTML tags are not checked (the pages use neither);
  - every mention of a page as `docs/<page>.md` in the tracked sources, scripts and pages
    (comments and prose, where a page that was split or renamed leaves a stale pointer) must
    name a page that exists;
  - a mention followed by a quoted section, `docs/<page>.md, "Section"`, must name a heading of
    that page (a heading containing the quoted text, case and backticks aside).

Each problem is printed with its file and line; the exit status is 1 if there is any. ctest runs
it as docs.links (tests/CMakeLists.txt). Outside a git checkout it walks the tree instead, leaving
hidden folders and build* out. Usage: check_doc_links.py REPOSITORY_ROOT
"""
import fnmatch
import os
import re
import subprocess
import sys

# [text](target) and [text](target "title"); images too (![alt](target)).
LINK = re.compile(r"\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
FENCE = re.compile(r"^\s*(```|~~~)")
SKIP = ("http://", "https://", "mailto:", "#")
DOC_MENTION = re.compile(r"(?<![\w/.-])(docs/[\w-]+(?:/[\w-]+)*\.md)\b(?:,? \"([^\"]+)\")?")
MENTION_FILES = ("*.md", "*.h", "*.cpp", "*.cu", "*.cuh", "*.py", "*.txt", "*.cmake", "*.sh",
                 "*.in", "*.inc", "scripts/*", ".ci/*")


def tracked_files(root, patterns):
    """The files below root that git tracks and that match one of `patterns` (relative paths);
    every such file below root when root is not a git checkout or git is missing."""
    try:
        listed = subprocess.run(["git", "ls-files", *patterns], cwd=root, capture_output=True,
                                text=True)
        if listed.returncode == 0:
            return listed.stdout.split()
    except FileNotFoundError:
        pass
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.startswith("build")]
        for name in files:
            relative = os.path.relpath(os.path.join(folder, name), root)
            if any(fnmatch.fnmatch(relative, p) or fnmatch.fnmatch(name, p) for p in patterns):
                found.append(relative)
    return found


def read_lines(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().split("\n")
    except (OSError, UnicodeDecodeError):
        return None


def headings(path):
    lines = read_lines(path) or []
    return [l.lstrip("#").strip().replace("`", "").lower() for l in lines if l.startswith("#")]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: check_doc_links.py REPOSITORY_ROOT")
    root = os.path.realpath(sys.argv[1])
    problems, links = [], 0
    for relative in sorted(tracked_files(root, ["*.md"])):
        path = os.path.join(root, relative)
        lines = read_lines(path)
        if lines is None:
            continue
        in_code = False
        for number, line in enumerate(lines, start=1):
            if FENCE.match(line):
                in_code = not in_code
                continue
            if in_code:
                continue
            for target in LINK.findall(CODE_SPAN.sub("", line)):
                if target.startswith(SKIP):
                    continue
                links += 1
                file_part = target.split("#", 1)[0]
                resolved = os.path.realpath(os.path.join(os.path.dirname(path), file_part))
                where = f"{relative}:{number}: '{target}'"
                if os.path.commonpath([resolved, root]) != root:
                    problems.append(f"{where} points outside the repository")
                elif not os.path.exists(resolved):
                    problems.append(f"{where} names {os.path.relpath(resolved, root)}, which "
                                    "does not exist")
    mentions = sections = 0
    for relative in tracked_files(root, list(MENTION_FILES)):
        lines = read_lines(os.path.join(root, relative))
        if lines is None:
            continue
        for number, line in enumerate(lines, start=1):
            for page, section in DOC_MENTION.findall(line):
                mentions += 1
                target = os.path.join(root, page)
                if not os.path.exists(target):
                    problems.append(f"{relative}:{number}: mentions {page}, which does not exist")
                elif section:
                    sections += 1
                    wanted = section.replace("`", "").lower()
                    if not any(wanted in h for h in headings(target)):
                        problems.append(f"{relative}:{number}: {page} has no section "
                                        f"\"{section}\"")
    for p in problems:
        print(p)
    print(f"{links} relative links, {mentions} mentions of docs/ pages and {sections} of their "
          f"sections checked, {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
