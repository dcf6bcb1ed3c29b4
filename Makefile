# Shortcuts for `python3 course.py ...` (which needs nothing but Python; use it where make is missing).
.PHONY: lab test doctor build
lab:
	python3 course.py lab
test:
	python3 course.py test
doctor:
	python3 course.py doctor
build:
	python3 course.py build
