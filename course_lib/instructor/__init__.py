"""The instructor's and maintainer's tools: the ``course`` command and what it runs.

    cli.py           the ``course`` command: doctor, lab, run, build, grade, gpu-check, lab-report
    gpu_check.py     ``course gpu-check``: a node's self-test before class
    lab_report.py    ``course lab-report``: every lesson run, every comparison checked, one HTML report
    browser.py       lessons in JupyterLab in headless Chromium (the browser test, tools/lab_smoke.py)
    catalog.py       the lesson notebooks as files
    lab_settings.py  JupyterLab as the course runs it (no news prompt, the course kernel)

May import everything below it (the core, runtime, measure, theory, parallel, training, grading) and itself; never
`course_lib.lessons` (tests/test_layout.py): a tool runs lessons as notebooks, it does not call into them.
"""
