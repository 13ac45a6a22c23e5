/* The suffix trie of `suffix.py` (`SuffixTrie`) in C, loaded through ctypes (`native_suffix.py`).
 *
 * The same structure and the same results as the Python class, node for node: explicit nodes (substrings that
 * occurred at least twice) in flat arrays, implicit ones (occurred once) as negative references to a position of a
 * sequence, -((seq << 32) | pos) - 1. A node with one child keeps it inline (`kid_token` / `kid`); a node with
 * several (`kid_token == MANY`) keeps them in an edge list in insertion order (the order Python's dict gives, which
 * the drafts' tie-breaking follows), found through one hash table keyed by (node, token).
 *
 * Why C: building a prompt's trie visits up to `depth` nodes per token; in Python that was ~40% of a serving step's
 * host time. Every entry point validates the references it is given (a drafter may hold references to a trie that
 * evicted them since: they read as nodes without children), and every mutation reserves its memory before it
 * changes anything, so an allocation failure leaves the trie as it was.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TOK_NONE (-1)
#define TOK_MANY (-2)
#define KEY_EMPTY UINT64_MAX
#define KEY_TOMB (UINT64_MAX - 1)
#define ERR_NOMEM (-1)
#define ERR_BAD (-2)

typedef struct {
    int32_t *data;
    int64_t len, cap;
} Seq;

typedef struct {
    int64_t depth;
    /* explicit nodes */
    int32_t *count, *total, *kid_token;
    int64_t *kid; /* the one child's reference; for a MANY node, the first edge of its child list */
    int64_t n_nodes, cap_nodes;
    int64_t *free_nodes;
    int64_t n_free, cap_free;
    int64_t n_many;
    /* edges of MANY nodes: a circular doubly linked list per node, in insertion order */
    int32_t *e_token;
    int64_t *e_child, *e_next, *e_prev;
    int64_t n_edges, cap_edges, free_edge, live_edges;
    /* (node, token) -> edge */
    uint64_t *h_key;
    int64_t *h_val;
    int64_t h_cap, h_fill, h_live;
    /* sequences by id */
    Seq **seqs;
    int64_t cap_seqs, next_seq;
    /* scratch of the best-first growth */
    void *heap;
    int64_t heap_cap;
} Trie;

typedef struct {
    double p;
    int64_t tie, child, parent, depth;
    int32_t token;
} Entry;

static inline int64_t implicit_ref(int64_t seq, int64_t pos) { return -((seq << 32) | pos) - 1; }
static inline int64_t ref_seq(int64_t ref) { return (-ref - 1) >> 32; }
static inline int64_t ref_pos(int64_t ref) { return (-ref - 1) & 0xFFFFFFFFLL; }
static inline uint64_t edge_key(int64_t node, int32_t token) { return ((uint64_t)node << 32) | (uint32_t)token; }

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static int grow(void **ptr, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) return 0;
    int64_t n = *cap < 16 ? 16 : *cap;
    while (n < need) n *= 2;
    void *p = realloc(*ptr, (size_t)n * item);
    if (!p) return ERR_NOMEM;
    *ptr = p;
    *cap = n;
    return 0;
}

/* ------------------------------------------------------------------ hash */
static int64_t hash_get(const Trie *t, uint64_t key) {
    if (!t->h_cap) return -1;
    uint64_t mask = (uint64_t)t->h_cap - 1, i = mix(key) & mask;
    while (t->h_key[i] != KEY_EMPTY) {
        if (t->h_key[i] == key) return t->h_val[i];
        i = (i + 1) & mask;
    }
    return -1;
}

static int hash_rebuild(Trie *t, int64_t cap) {
    uint64_t *keys = malloc((size_t)cap * sizeof(uint64_t));
    int64_t *vals = malloc((size_t)cap * sizeof(int64_t));
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return ERR_NOMEM;
    }
    for (int64_t i = 0; i < cap; i++) keys[i] = KEY_EMPTY;
    uint64_t mask = (uint64_t)cap - 1;
    for (int64_t j = 0; j < t->h_cap; j++) {
        uint64_t key = t->h_key[j];
        if (key == KEY_EMPTY || key == KEY_TOMB) continue;
        uint64_t i = mix(key) & mask;
        while (keys[i] != KEY_EMPTY) i = (i + 1) & mask;
        keys[i] = key;
        vals[i] = t->h_val[j];
    }
    free(t->h_key);
    free(t->h_val);
    t->h_key = keys;
    t->h_val = vals;
    t->h_cap = cap;
    t->h_fill = t->h_live;
    return 0;
}

/* Room for `extra` more keys at a load of at most 1/2 (tombstones included). */
static int hash_reserve(Trie *t, int64_t extra) {
    if ((t->h_fill + extra) * 2 <= t->h_cap) return 0;
    int64_t cap = 16;
    while (cap < (t->h_live + extra) * 4) cap *= 2;
    return hash_rebuild(t, cap);
}

static void hash_put(Trie *t, uint64_t key, int64_t val) { /* key absent; room reserved */
    uint64_t mask = (uint64_t)t->h_cap - 1, i = mix(key) & mask;
    while (t->h_key[i] != KEY_EMPTY && t->h_key[i] != KEY_TOMB) i = (i + 1) & mask;
    if (t->h_key[i] == KEY_EMPTY) t->h_fill++;
    t->h_key[i] = key;
    t->h_val[i] = val;
    t->h_live++;
}

static void hash_del(Trie *t, uint64_t key) {
    if (!t->h_cap) return;
    uint64_t mask = (uint64_t)t->h_cap - 1, i = mix(key) & mask;
    while (t->h_key[i] != KEY_EMPTY) {
        if (t->h_key[i] == key) {
            t->h_key[i] = KEY_TOMB;
            t->h_live--;
            return;
        }
        i = (i + 1) & mask;
    }
}

/* ------------------------------------------------------------------ reservations */
/* Parallel arrays of one capacity `*cap` (`n` of them, `cols[i]` of items `sizes[i]` bytes) grown to hold `need`. */
static int grow_columns(void **cols[], const size_t sizes[], int n, int64_t *cap, int64_t need) {
    int64_t c = *cap;
    for (int i = 0; i < n; i++) {
        c = *cap;
        if (grow(cols[i], &c, need, sizes[i])) return ERR_NOMEM;
    }
    *cap = c;
    return 0;
}

static int reserve(Trie *t, int64_t nodes, int64_t edges) {
    if (t->n_nodes + nodes > t->cap_nodes) {
        void **cols[] = {(void **)&t->count, (void **)&t->total, (void **)&t->kid_token, (void **)&t->kid};
        const size_t sizes[] = {sizeof(int32_t), sizeof(int32_t), sizeof(int32_t), sizeof(int64_t)};
        if (grow_columns(cols, sizes, 4, &t->cap_nodes, t->n_nodes + nodes)) return ERR_NOMEM;
    }
    if (t->n_edges + edges > t->cap_edges) {
        void **cols[] = {(void **)&t->e_token, (void **)&t->e_child, (void **)&t->e_next, (void **)&t->e_prev};
        const size_t sizes[] = {sizeof(int32_t), sizeof(int64_t), sizeof(int64_t), sizeof(int64_t)};
        if (grow_columns(cols, sizes, 4, &t->cap_edges, t->n_edges + edges)) return ERR_NOMEM;
    }
    return hash_reserve(t, edges);
}

static Seq *seq_get(const Trie *t, int64_t seq) {
    return (seq >= 0 && seq < t->cap_seqs) ? t->seqs[seq] : NULL;
}

static Seq *seq_make(Trie *t, int64_t seq) {
    if (seq < 0 || seq > 0x7FFFFFFFLL) return NULL;
    Seq *s = seq_get(t, seq);
    if (s) return s;
    if (seq >= t->cap_seqs) {
        int64_t old = t->cap_seqs;
        if (grow((void **)&t->seqs, &t->cap_seqs, seq + 1, sizeof(Seq *))) return NULL;
        for (int64_t i = old; i < t->cap_seqs; i++) t->seqs[i] = NULL;
    }
    s = calloc(1, sizeof(Seq));
    if (!s) return NULL;
    t->seqs[seq] = s;
    if (seq + 1 > t->next_seq) t->next_seq = seq + 1;
    return s;
}

/* ------------------------------------------------------------------ nodes and edges */
static int64_t node_new(Trie *t) { /* room reserved */
    int64_t n;
    if (t->n_free) {
        n = t->free_nodes[--t->n_free];
    } else {
        n = t->n_nodes++;
        t->kid[n] = 0;
    }
    t->count[n] = 2;
    t->total[n] = 0;
    t->kid_token[n] = TOK_NONE;
    return n;
}

static int64_t edge_new(Trie *t, int64_t node, int32_t token, int64_t child) { /* room reserved */
    int64_t e;
    if (t->free_edge >= 0) {
        e = t->free_edge;
        t->free_edge = t->e_next[e];
    } else {
        e = t->n_edges++;
    }
    t->e_token[e] = token;
    t->e_child[e] = child;
    hash_put(t, edge_key(node, token), e);
    t->live_edges++;
    return e;
}

static void edge_append(Trie *t, int64_t node, int32_t token, int64_t child) { /* node is MANY */
    int64_t e = edge_new(t, node, token, child), head = t->kid[node], tail = t->e_prev[head];
    t->e_next[tail] = e;
    t->e_prev[e] = tail;
    t->e_next[e] = head;
    t->e_prev[head] = e;
}

static void edge_free(Trie *t, int64_t node, int64_t e) {
    hash_del(t, edge_key(node, t->e_token[e]));
    t->e_next[e] = t->free_edge;
    t->free_edge = e;
    t->live_edges--;
}

static void make_many(Trie *t, int64_t node, int32_t token, int64_t child) { /* node has one child: add another */
    int32_t kt = t->kid_token[node];
    int64_t first = edge_new(t, node, kt, t->kid[node]);
    t->e_next[first] = t->e_prev[first] = first;
    t->kid_token[node] = TOK_MANY;
    t->kid[node] = first;
    t->n_many++;
    edge_append(t, node, token, child);
}

/* The child of explicit `node` for `token` (its reference in *child), its edge in *edge (-1 when inline): 1 found. */
static int child_of(const Trie *t, int64_t node, int32_t token, int64_t *child, int64_t *edge) {
    if (node < 0 || node >= t->n_nodes) return 0;
    int32_t kt = t->kid_token[node];
    *edge = -1;
    if (kt == token) {
        *child = t->kid[node];
        return 1;
    }
    if (kt == TOK_MANY) {
        int64_t e = hash_get(t, edge_key(node, token));
        if (e < 0) return 0;
        *edge = e;
        *child = t->e_child[e];
        return 1;
    }
    return 0;
}

static void del_child(Trie *t, int64_t node, int32_t token) {
    int32_t kt = t->kid_token[node];
    if (kt == token) {
        t->kid_token[node] = TOK_NONE;
        return;
    }
    int64_t e = hash_get(t, edge_key(node, token));
    if (e < 0) return;
    int64_t next = t->e_next[e], prev = t->e_prev[e];
    t->e_next[prev] = next;
    t->e_prev[next] = prev;
    if (t->kid[node] == e) t->kid[node] = next;
    edge_free(t, node, e);
    int64_t head = t->kid[node];
    if (t->e_next[head] == head) { /* one child left: inline again */
        t->kid_token[node] = t->e_token[head];
        t->kid[node] = t->e_child[head];
        edge_free(t, node, head);
        t->n_many--;
    }
}

static void release(Trie *t, int64_t node) {
    int64_t *stack = NULL, n = 0, cap = 0;
    if (grow((void **)&stack, &cap, 1, sizeof(int64_t))) return;
    stack[n++] = node;
    while (n) {
        int64_t m = stack[--n];
        int32_t kt = t->kid_token[m];
        if (kt == TOK_MANY) {
            int64_t head = t->kid[m], e = head;
            do {
                int64_t next = t->e_next[e];
                if (t->e_child[e] >= 0 && !grow((void **)&stack, &cap, n + 1, sizeof(int64_t)))
                    stack[n++] = t->e_child[e];
                edge_free(t, m, e);
                e = next;
            } while (e != head);
            t->n_many--;
        } else if (kt != TOK_NONE && t->kid[m] >= 0) {
            if (!grow((void **)&stack, &cap, n + 1, sizeof(int64_t))) stack[n++] = t->kid[m];
        }
        t->count[m] = t->total[m] = 0;
        t->kid_token[m] = TOK_NONE;
        if (!grow((void **)&t->free_nodes, &t->cap_free, t->n_free + 1, sizeof(int64_t)))
            t->free_nodes[t->n_free++] = m;
    }
    free(stack);
}

/* ------------------------------------------------------------------ API */
Trie *trie_new(int64_t depth) {
    Trie *t = calloc(1, sizeof(Trie));
    if (!t) return NULL;
    t->depth = depth;
    t->free_edge = -1;
    if (reserve(t, 1, 0)) {
        free(t);
        return NULL;
    }
    t->n_nodes = 1; /* the root */
    t->count[0] = t->total[0] = 0;
    t->kid_token[0] = TOK_NONE;
    t->kid[0] = 0;
    return t;
}

void trie_free(Trie *t) {
    if (!t) return;
    free(t->count); free(t->total); free(t->kid_token); free(t->kid); free(t->free_nodes);
    free(t->e_token); free(t->e_child); free(t->e_next); free(t->e_prev);
    free(t->h_key); free(t->h_val); free(t->heap);
    for (int64_t i = 0; i < t->cap_seqs; i++)
        if (t->seqs[i]) {
            free(t->seqs[i]->data);
            free(t->seqs[i]);
        }
    free(t->seqs);
    free(t);
}

static void *dup(const void *p, size_t bytes) {
    if (!bytes) return NULL;
    void *q = malloc(bytes);
    if (q) memcpy(q, p, bytes);
    return q;
}

Trie *trie_copy(const Trie *t) {
    Trie *c = calloc(1, sizeof(Trie));
    if (!c) return NULL;
    *c = *t;
    c->heap = NULL;
    c->heap_cap = 0;
    c->count = dup(t->count, t->cap_nodes * sizeof(int32_t));
    c->total = dup(t->total, t->cap_nodes * sizeof(int32_t));
    c->kid_token = dup(t->kid_token, t->cap_nodes * sizeof(int32_t));
    c->kid = dup(t->kid, t->cap_nodes * sizeof(int64_t));
    c->free_nodes = dup(t->free_nodes, t->cap_free * sizeof(int64_t));
    c->e_token = dup(t->e_token, t->cap_edges * sizeof(int32_t));
    c->e_child = dup(t->e_child, t->cap_edges * sizeof(int64_t));
    c->e_next = dup(t->e_next, t->cap_edges * sizeof(int64_t));
    c->e_prev = dup(t->e_prev, t->cap_edges * sizeof(int64_t));
    c->h_key = dup(t->h_key, t->h_cap * sizeof(uint64_t));
    c->h_val = dup(t->h_val, t->h_cap * sizeof(int64_t));
    c->seqs = t->cap_seqs ? calloc((size_t)t->cap_seqs, sizeof(Seq *)) : NULL;
    int ok = (c->count || !t->cap_nodes) && (c->total || !t->cap_nodes) && (c->kid_token || !t->cap_nodes) &&
             (c->kid || !t->cap_nodes) && (c->free_nodes || !t->cap_free) && (c->e_token || !t->cap_edges) &&
             (c->e_child || !t->cap_edges) && (c->e_next || !t->cap_edges) && (c->e_prev || !t->cap_edges) &&
             (c->h_key || !t->h_cap) && (c->h_val || !t->h_cap) && (c->seqs || !t->cap_seqs);
    for (int64_t i = 0; ok && i < t->cap_seqs; i++) {
        const Seq *s = t->seqs[i];
        if (!s) continue;
        Seq *d = calloc(1, sizeof(Seq));
        if (!d) { ok = 0; break; }
        c->seqs[i] = d;
        d->len = d->cap = s->len;
        d->data = dup(s->data, s->len * sizeof(int32_t));
        if (!d->data && s->len) ok = 0;
    }
    if (!ok) {
        if (!c->seqs) c->cap_seqs = 0;
        trie_free(c);
        return NULL;
    }
    return c;
}

int64_t trie_new_seq(Trie *t) {
    int64_t seq = t->next_seq;
    return seq_make(t, seq) ? seq : ERR_NOMEM;
}

/* The nodes whose children are the suffixes after one more token: the root, then the `active` ones (suffixes of
 * length 1, 2, ...) that stay within `depth`, into `parents`; returns how many. */
static inline int64_t suffix_parents(int64_t *parents, const int64_t *active, int64_t n_active, int64_t depth) {
    int64_t L = 1 + (n_active < depth - 1 ? n_active : depth - 1);
    parents[0] = 0;
    for (int64_t k = 1; k < L; k++) parents[k] = active[k - 1];
    return L;
}

/* Append `tokens` to sequence `seq` (created if new). `active[0 .. n_active)` are the nodes of the sequence's
 * suffixes of length 1, 2, ... before them (room for `depth` in the buffer); returns the new count, or < 0. */
int64_t trie_extend(Trie *t, int64_t seq, const int32_t *tokens, int64_t n, int64_t *active, int64_t n_active) {
    const int64_t depth = t->depth;
    Seq *s = seq_make(t, seq);
    if (!s) return ERR_NOMEM;
    if (n_active > depth) n_active = depth;
    for (int64_t k = 0; k < n_active; k++) { /* references from this trie: valid, or the caller is confused */
        int64_t ref = active[k];
        if (ref >= t->n_nodes || (ref < 0 && !seq_get(t, ref_seq(ref)))) return ERR_BAD;
    }
    int64_t buf_nodes[depth + 1];
    for (int64_t i = 0; i < n; i++) {
        int32_t token = tokens[i];
        if (token < 0) return ERR_BAD;
        if (s->len >= 0xFFFFFFFFLL) return ERR_BAD;
        if (reserve(t, depth, 2 * depth)) return ERR_NOMEM;
        if (grow((void **)&s->data, &s->cap, s->len + 1, sizeof(int32_t))) return ERR_NOMEM;
        s->data[s->len++] = token;
        int64_t here = implicit_ref(seq, s->len - 1);
        int64_t L = suffix_parents(buf_nodes, active, n_active, depth);
        int64_t n_new = 0;
        for (int64_t d = 1; d <= L; d++) {
            int64_t node = buf_nodes[d - 1];
            if (node < 0) { /* this and every longer suffix occurred once: their children are all `here` */
                for (int64_t k = 0; k < L - d + 1; k++) active[n_new++] = here;
                break;
            }
            int32_t kt = t->kid_token[node];
            int64_t child, edge = -1;
            int found = child_of(t, node, token, &child, &edge);
            if (!found) {
                child = here;
                if (kt == TOK_NONE) {
                    t->kid_token[node] = token;
                    t->kid[node] = here;
                } else if (kt == TOK_MANY) {
                    edge_append(t, node, token, here);
                } else {
                    make_many(t, node, token, here);
                }
            } else if (child >= 0) {
                t->count[child]++;
            } else { /* it occurred once before: an explicit node now, that occurrence's continuation its child */
                int64_t old_seq = ref_seq(child), old_pos = ref_pos(child);
                int64_t fresh = node_new(t);
                const Seq *old = seq_get(t, old_seq);
                if (old && d < depth && old_pos + 1 < old->len) {
                    t->kid_token[fresh] = old->data[old_pos + 1];
                    t->kid[fresh] = implicit_ref(old_seq, old_pos + 1);
                    t->total[fresh] = 1;
                }
                if (edge < 0) t->kid[node] = fresh;
                else t->e_child[edge] = fresh;
                child = fresh;
            }
            t->total[node]++;
            active[n_new++] = child;
        }
        n_active = n_new;
    }
    return n_active;
}

/* Read-only `trie_extend`: the nodes of the context's suffixes that exist in the trie. */
int64_t trie_follow(const Trie *t, const int32_t *tokens, int64_t n, int64_t *active, int64_t n_active) {
    const int64_t depth = t->depth;
    if (n_active > depth) n_active = depth;
    int64_t buf_nodes[depth + 1];
    for (int64_t i = 0; i < n; i++) {
        int32_t token = tokens[i];
        int64_t L = suffix_parents(buf_nodes, active, n_active, depth);
        int64_t n_new = 0;
        for (int64_t d = 1; d <= L; d++) {
            int64_t node = buf_nodes[d - 1];
            if (node < 0) {
                const Seq *s = seq_get(t, ref_seq(node));
                int64_t pos = ref_pos(node);
                if (s && pos + 1 < s->len && s->data[pos + 1] == token)
                    for (int64_t k = 0; k < L - d + 1; k++) active[n_new++] = node - 1; /* (seq, pos + 1) */
                break;
            }
            int64_t child, edge;
            if (!child_of(t, node, token, &child, &edge)) break; /* no (k+1)-gram: no longer one either */
            active[n_new++] = child;
        }
        n_active = n_new;
    }
    return n_active;
}

/* Cut sequence `seq` back to its first `keep` tokens (0 removes it), taking out what its later positions added. */
int64_t trie_truncate(Trie *t, int64_t seq, int64_t keep) {
    Seq *s = seq_get(t, seq);
    if (!s) return 0;
    int64_t n = s->len;
    if (keep < 0) keep = 0;
    if (keep > n) keep = n;
    int64_t first = keep - t->depth + 1 > 0 ? keep - t->depth + 1 : 0;
    for (int64_t start = first; start < n; start++) {
        int64_t node = 0, end = start + t->depth < n ? start + t->depth : n;
        for (int64_t pos = start; pos < end; pos++) {
            if (node < 0) break; /* below an implicit node lies only this occurrence */
            int32_t token = s->data[pos];
            int64_t child, edge;
            if (!child_of(t, node, token, &child, &edge)) break;
            if (pos >= keep) {
                t->total[node]--;
                if (child < 0 || t->count[child] == 1) {
                    del_child(t, node, token);
                    if (child >= 0) release(t, child);
                    break;
                }
                t->count[child]--;
            }
            node = child;
        }
    }
    if (keep == 0) {
        free(s->data);
        free(s);
        t->seqs[seq] = NULL;
    } else {
        s->len = keep;
    }
    return 0;
}

int64_t trie_count(const Trie *t, int64_t ref) {
    if (ref >= 0) return ref < t->n_nodes ? t->count[ref] : 0;
    return 1;
}

int64_t trie_total(const Trie *t, int64_t ref, int64_t depth) {
    if (ref >= 0) return ref < t->n_nodes ? t->total[ref] : 0;
    if (depth >= t->depth) return 0;
    const Seq *s = seq_get(t, ref_seq(ref));
    return s && ref_pos(ref) + 1 < s->len ? 1 : 0;
}

/* The (token, child) pairs of `ref` (a node at `depth`), at most `max` written; returns how many there are. */
int64_t trie_children(const Trie *t, int64_t ref, int64_t depth, int32_t *tokens, int64_t *kids, int64_t max) {
    if (ref >= 0) {
        if (ref >= t->n_nodes) return 0;
        int32_t kt = t->kid_token[ref];
        if (kt == TOK_NONE) return 0;
        if (kt != TOK_MANY) {
            if (max > 0) { tokens[0] = kt; kids[0] = t->kid[ref]; }
            return 1;
        }
        int64_t head = t->kid[ref], e = head, n = 0;
        do {
            if (n < max) { tokens[n] = t->e_token[e]; kids[n] = t->e_child[e]; }
            n++;
            e = t->e_next[e];
        } while (e != head);
        return n;
    }
    if (depth >= t->depth) return 0;
    const Seq *s = seq_get(t, ref_seq(ref));
    int64_t pos = ref_pos(ref);
    if (!s || pos + 1 >= s->len) return 0;
    if (max > 0) { tokens[0] = s->data[pos + 1]; kids[0] = ref - 1; }
    return 1;
}

/* For an implicit `ref` at `depth`: the tokens after its one occurrence, at most `limit`; returns how many. */
int64_t trie_occurrence_after(const Trie *t, int64_t ref, int64_t depth, int64_t limit, int32_t *out) {
    if (ref >= 0) return 0;
    const Seq *s = seq_get(t, ref_seq(ref));
    if (!s) return 0;
    int64_t pos = ref_pos(ref), n = limit;
    if (t->depth - depth < n) n = t->depth - depth;
    if (s->len - 1 - pos < n) n = s->len - 1 - pos;
    if (n <= 0) return 0;
    memcpy(out, s->data + pos + 1, (size_t)n * sizeof(int32_t));
    return n;
}

int64_t trie_seq_len(const Trie *t, int64_t seq) {
    const Seq *s = seq_get(t, seq);
    return s ? s->len : 0;
}

int64_t trie_seq_read(const Trie *t, int64_t seq, int32_t *out) {
    const Seq *s = seq_get(t, seq);
    if (!s) return 0;
    memcpy(out, s->data, (size_t)s->len * sizeof(int32_t));
    return s->len;
}

int64_t trie_num_nodes(const Trie *t) { return t->n_nodes - t->n_free; }
int64_t trie_next_seq(const Trie *t) { return t->next_seq; }

int64_t trie_num_tokens(const Trie *t) {
    int64_t n = 0;
    for (int64_t i = 0; i < t->cap_seqs; i++)
        if (t->seqs[i]) n += t->seqs[i]->len;
    return n;
}

int64_t trie_nbytes(const Trie *t) {
    return t->cap_nodes * (3 * sizeof(int32_t) + sizeof(int64_t)) + t->cap_free * sizeof(int64_t) +
           t->cap_edges * (sizeof(int32_t) + 3 * sizeof(int64_t)) + t->h_cap * (sizeof(uint64_t) + sizeof(int64_t)) +
           t->cap_seqs * sizeof(Seq *) + trie_num_tokens(t) * sizeof(int32_t);
}

/* ------------------------------------------------------------------ drafting */
typedef struct {
    int64_t max_match_length, max_nodes, max_depth, tree;
    double spec_factor, spec_offset, min_token_prob;
} GrowParams;

typedef struct {
    Trie *t;
    const GrowParams *g;
    int64_t match_length, n_heap, tie;
} Grower;

static inline int entry_before(const Entry *a, const Entry *b) { /* higher p first, then the earlier push */
    return a->p > b->p || (a->p == b->p && a->tie < b->tie);
}

static int heap_push(Grower *w, Entry x) {
    Trie *t = w->t;
    if (grow(&t->heap, &t->heap_cap, w->n_heap + 1, sizeof(Entry))) return ERR_NOMEM;
    Entry *h = t->heap;
    int64_t i = w->n_heap++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!entry_before(&x, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
    return 0;
}

static Entry heap_pop(Grower *w) {
    Entry *h = w->t->heap, top = h[0], last = h[--w->n_heap];
    int64_t i = 0, n = w->n_heap;
    while (1) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && entry_before(&h[c + 1], &h[c])) c++;
        if (!entry_before(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (n) h[i] = last;
    return top;
}

static int push_children(Grower *w, int64_t parent, double parent_prob, int64_t parent_idx, int64_t depth) {
    const GrowParams *g = w->g;
    Trie *t = w->t;
    if (depth > g->max_depth) return 0;
    int64_t trie_depth = w->match_length + depth - 1;
    int64_t total = trie_total(t, parent, trie_depth);
    if (total == 0) return 0;
    int32_t one_token;
    int64_t one_kid, head = -1, e = -1;
    if (parent >= 0 && parent < t->n_nodes && t->kid_token[parent] == TOK_MANY) {
        head = e = t->kid[parent];
    } else if (trie_children(t, parent, trie_depth, &one_token, &one_kid, 1) == 0) {
        return 0;
    }
    if (!g->tree && head >= 0) { /* the most frequent child, the first of equals */
        int64_t best = head, best_count = trie_count(t, t->e_child[head]);
        for (e = t->e_next[head]; e != head; e = t->e_next[e]) {
            int64_t c = trie_count(t, t->e_child[e]);
            if (c > best_count) { best = e; best_count = c; }
        }
        one_token = t->e_token[best];
        one_kid = t->e_child[best];
        head = -1;
    }
    if (head < 0) {
        double p = parent_prob * (double)trie_count(t, one_kid) / (double)total;
        if (p >= g->min_token_prob) {
            Entry x = {p, w->tie++, one_kid, parent_idx, depth, one_token};
            return heap_push(w, x);
        }
        return 0;
    }
    e = head;
    do {
        double p = parent_prob * (double)trie_count(t, t->e_child[e]) / (double)total;
        if (p >= g->min_token_prob) {
            Entry x = {p, w->tie++, t->e_child[e], parent_idx, depth, t->e_token[e]};
            if (heap_push(w, x)) return ERR_NOMEM;
        }
        e = t->e_next[e];
    } while (e != head);
    return 0;
}

/* The best-first tree from `node`, a match of `match_length`: its size (0: none), score in *score. */
static int64_t grow_one(Trie *t, const GrowParams *g, int64_t node, int64_t match_length, int32_t *tokens,
                        int64_t *parents, double *probs, double *score) {
    int64_t cap = (int64_t)((double)match_length * g->spec_factor + g->spec_offset);
    if (g->max_nodes < cap) cap = g->max_nodes;
    if (cap <= 0) return 0;
    if (node < 0) { /* a substring that occurred once: the tree is its occurrence's chain */
        if (g->min_token_prob > 1.0) return 0;
        int64_t n = trie_occurrence_after(t, node, match_length, cap < g->max_depth ? cap : g->max_depth, tokens);
        for (int64_t i = 0; i < n; i++) {
            parents[i] = i - 1;
            probs[i] = 1.0;
        }
        *score = (double)n;
        return n;
    }
    Grower w = {t, g, match_length, 0, 0};
    if (push_children(&w, node, 1.0, -1, 1)) return ERR_NOMEM;
    int64_t n = 0;
    while (w.n_heap && n < cap) {
        Entry x = heap_pop(&w);
        tokens[n] = x.token;
        parents[n] = x.parent;
        probs[n] = x.p;
        n++;
        if (push_children(&w, x.child, x.p, n - 1, x.depth + 1)) return ERR_NOMEM;
    }
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += probs[i];
    *score = s;
    return n;
}

/* The best draft over every match of the context whose suffix nodes are `active[0 .. n_active)`: its size (0: none),
 * written to tokens / parents / probs (room for `max_nodes` each), its score and match length. `work_*` are scratch
 * of the same size. */
int64_t trie_best_draft(Trie *t, const int64_t *active, int64_t n_active, int64_t max_match_length,
                        double spec_factor, double spec_offset, int64_t max_nodes, int64_t max_depth,
                        double min_token_prob, int64_t tree, int32_t *tokens, int64_t *parents, double *probs,
                        int32_t *work_tokens, int64_t *work_parents, double *work_probs, double *score,
                        int64_t *match_length) {
    GrowParams g = {max_match_length, max_nodes, max_depth, tree, spec_factor, spec_offset, min_token_prob};
    int64_t best = 0, prev_count = -1;
    double best_score = 0.0;
    int64_t top = n_active < max_match_length ? n_active : max_match_length;
    for (int64_t m = top; m > 0; m--) {
        int64_t node = active[m - 1];
        int64_t count = trie_count(t, node);
        if (count == prev_count) continue; /* a shorter match with the same count has the same continuations */
        prev_count = count;
        if (trie_total(t, node, m) == 0) continue;
        double s = 0.0;
        int64_t n = grow_one(t, &g, node, m, work_tokens, work_parents, work_probs, &s);
        if (n < 0) return n;
        if (n > 0 && (best == 0 || s > best_score)) {
            best = n;
            best_score = s;
            *match_length = m;
            memcpy(tokens, work_tokens, (size_t)n * sizeof(int32_t));
            memcpy(parents, work_parents, (size_t)n * sizeof(int64_t));
            memcpy(probs, work_probs, (size_t)n * sizeof(double));
        }
    }
    *score = best_score;
    return best;
}
