"""Hot switch (亚健康热切): migrate sub-healthy ranks to backup processes without losing a step.

Work in progress (issue #6, H7).
"""
