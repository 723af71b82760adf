"""Builds the two Keras models of models/keras/ and converts them with tf2onnx.

Runs in its own venv (TensorFlow and tf2onnx pin a protobuf the onnx stack does not accept):
`make keras-models` creates it from scripts/keras-requirements.txt. Writes, for each model,
`<name>.onnx` (opset 18, dynamic batch and sequence) and `<name>.io.npz` with Keras' own
outputs on a fixed input, the reference the tests compare against.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np
import tensorflow as tf
import tf2onnx

OPSET = 18


def transformer_lm(vocab=256, d=64, heads=4, blocks=4, max_len=64):
    """A pre-norm causal transformer LM: token and position embeddings, `blocks` blocks of
    attention and MLP, a final LayerNorm and a vocabulary projection."""
    ids = tf.keras.Input(shape=(None,), dtype="int32", name="input_ids")
    seq = tf.shape(ids)[1]
    x = tf.keras.layers.Embedding(vocab, d, name="tok_emb")(ids)
    pos = tf.keras.layers.Embedding(max_len, d, name="pos_emb")(tf.range(seq)[tf.newaxis, :])
    x = x + pos
    for i in range(blocks):
        h = tf.keras.layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}/ln_1")(x)
        h = tf.keras.layers.MultiHeadAttention(heads, d // heads, name=f"block_{i}/attn")(h, h, use_causal_mask=True)
        x = x + h
        h = tf.keras.layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}/ln_2")(x)
        h = tf.keras.layers.Dense(4 * d, activation="gelu", name=f"block_{i}/fc")(h)
        h = tf.keras.layers.Dense(d, name=f"block_{i}/proj")(h)
        x = x + h
    x = tf.keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")(x)
    logits = tf.keras.layers.Dense(vocab, name="lm_head")(x)
    return tf.keras.Model(ids, logits, name="keras_lm")


def cnn(classes=10, size=32):
    """A small VGG/ResNet-style image classifier: conv, BatchNorm, ReLU and pooling stages,
    global average pooling and a dense head."""
    img = tf.keras.Input(shape=(size, size, 3), name="pixels")
    x = img
    for i, ch in enumerate([16, 32, 64, 64]):
        x = tf.keras.layers.Conv2D(ch, 3, padding="same", use_bias=False, name=f"stage_{i}/conv_a")(x)
        x = tf.keras.layers.BatchNormalization(name=f"stage_{i}/bn_a")(x)
        x = tf.keras.layers.ReLU(name=f"stage_{i}/relu_a")(x)
        x = tf.keras.layers.Conv2D(ch, 3, padding="same", name=f"stage_{i}/conv_b")(x)
        x = tf.keras.layers.ReLU(name=f"stage_{i}/relu_b")(x)
        if i < 3:
            x = tf.keras.layers.MaxPooling2D(2, name=f"stage_{i}/pool")(x)
    x = tf.keras.layers.GlobalAveragePooling2D(name="gap")(x)
    logits = tf.keras.layers.Dense(classes, name="head")(x)
    return tf.keras.Model(img, logits, name="keras_cnn")


def convert(model, signature, path):
    tf2onnx.convert.from_keras(model, input_signature=signature, opset=OPSET, output_path=path)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="models/keras", help="output directory")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)

    lm = transformer_lm()
    ids = rng.integers(0, 256, (2, 16)).astype(np.int32)
    ref = lm(ids).numpy()
    convert(lm, [tf.TensorSpec((None, None), tf.int32, name="input_ids")], f"{args.out}/keras_lm.onnx")
    np.savez(f"{args.out}/keras_lm.io.npz", input_ids=ids, logits=ref)

    net = cnn()
    # Non-trivial running statistics, so eval-mode BatchNorm is exercised.
    for layer in net.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            n = layer.moving_mean.shape[0]
            layer.moving_mean.assign(rng.normal(0.0, 0.1, n).astype(np.float32))
            layer.moving_variance.assign(rng.uniform(0.5, 1.5, n).astype(np.float32))
    pixels = rng.standard_normal((2, 32, 32, 3)).astype(np.float32)
    ref = net(pixels, training=False).numpy()
    convert(net, [tf.TensorSpec((None, 32, 32, 3), tf.float32, name="pixels")], f"{args.out}/keras_cnn.onnx")
    np.savez(f"{args.out}/keras_cnn.io.npz", pixels=pixels, logits=ref)


if __name__ == "__main__":
    main()
