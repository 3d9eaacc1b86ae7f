# summarise py-spy raw (collapsed) stacks: share of samples per leaf-ish category
import sys, collections
tot = 0; cats = collections.Counter(); leaf = collections.Counter()
rules = [("gemv_bf16", "VNNI/row-major GEMV"), ("decode_layers", "compiled decode stack (other)"),
         ("paged", "paged attention"), ("attention", "attention"), ("dnnl", "oneDNN"), ("mkldnn", "oneDNN"),
         ("brgemm", "oneDNN"), ("jit", "oneDNN jit"), ("silu", "silu"), ("rms_norm", "rms_norm"), ("rope", "rope"),
         ("sample", "sampling"), ("logits", "logits"), ("build_step_inputs", "step inputs"), ("schedule", "scheduler")]
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); tot += n
    frames = stack.split(";")
    leaf[frames[-1][:110]] += n
print("total", tot)
for f, n in leaf.most_common(40):
    print(f"{100*n/tot:5.1f}% {f}")
