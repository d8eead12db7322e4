"""`dspark-compile inspect`: an engine directory read and explained, never changed.

    report.py, report_plots.py   the build report (passes, kernels, timings) and its plots
    onnx_export.py, onnx_domain.py, onnx_functional.py   an engine's step as ONNX
    tensorrt_report.py           which ops TensorRT could take (a report, no engine)
"""
