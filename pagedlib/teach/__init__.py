"""What the notebooks need besides the engine: sizing math, the calculator and tracer widgets, figures,
PTX tools, notebook helpers and the tiny model's training."""
