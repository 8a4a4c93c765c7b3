// ESLint for the Node client library and the Express example: `npm run lint`
// here, run by `make lint`. ESLint's recommended rules plus a few that catch
// real bugs in this code; each rule left out or loosened says why.
// Nothing is ignored but node_modules (ESLint's default); test/types/usage.ts
// is TypeScript, checked by `tsc -p test/types` in `npm test` instead.
import js from '@eslint/js';
import globals from 'globals';

export default [
  js.configs.recommended,
  {
    files: ['**/*.js'],
    languageOptions: {
      // The package supports Node 18 (package.json engines): syntax newer
      // than ES2022 is a parse error here rather than on a user's Node.
      ecmaVersion: 2022,
      sourceType: 'commonjs',
      globals: { ...globals.node },
    },
    linterOptions: {
      // A disable comment that no longer silences anything is itself a finding.
      reportUnusedDisableDirectives: 'error',
    },
    rules: {
      // An unused binding is usually a forgotten use (an answer never checked,
      // a lease never released). Arguments before the last used one stay: a
      // callback's position is fixed by its caller ((req, res, next), (call,
      // callback)). A caught error that is deliberately dropped is written
      // `catch {` (no binding), so caught errors are checked too. Names that
      // start with _ are declared unused on purpose.
      'no-unused-vars': ['error', {
        args: 'after-used',
        caughtErrors: 'all',
        argsIgnorePattern: '^_',
        varsIgnorePattern: '^_',
        destructuredArrayIgnorePattern: '^_',
        // `const { a, ...rest } = o` leaves a out of rest on purpose.
        ignoreRestSiblings: true,
      }],
      // == coerces (0 == '', null == undefined); `== null` is the one
      // intended use, for "null or undefined".
      eqeqeq: ['error', 'always', { null: 'ignore' }],
      'no-var': 'error',
      'prefer-const': ['error', { destructuring: 'all' }],
      // Beyond recommended: mistakes that parse and run (x === x, '${x}' in a
      // plain string, a loop that always exits at once, throwing a string,
      // parseInt without a radix, +x for Number(x), a comma where a
      // semicolon was meant, an assignment returned where a comparison was).
      'no-self-compare': 'error',
      'no-template-curly-in-string': 'error',
      'no-unreachable-loop': 'error',
      'no-constructor-return': 'error',
      'no-throw-literal': 'error',
      'no-return-assign': 'error',
      'no-sequences': 'error',
      'no-implicit-coercion': ['error', { allow: ['!!'] }],
      radix: 'error',
      'prefer-promise-reject-errors': 'error',
      // Every CommonJS file starts with 'use strict'.
      strict: ['error', 'global'],
      // Left out, with the reason:
      // - no-promise-executor-return: it flags every `new Promise((r) =>
      //   setTimeout(r, ms))` and `(resolve) => server.once('x', resolve)`,
      //   the way this code waits for a callback; nothing reads those returns.
      // - no-unmodified-loop-condition: it cannot see a flag set by a
      //   callback across an await (`while (!over) { ... await ... }`).
      // - require-atomic-updates: it flags a property of a request or a test's
      //   fake set after an await (the Fastify hook's request.raw.rawBody),
      //   which nothing else writes meanwhile; three findings, none a race.
      // - no-await-in-loop: retries and polls await in a loop on purpose.
      // - floating promises and async callbacks whose promise is dropped
      //   (no-floating-promises, no-misused-promises) need type information:
      //   typescript-eslint rules, not available to plain ESLint on JavaScript.
    },
  },
  {
    // The ES module entry point.
    files: ['**/*.mjs'],
    languageOptions: {
      ecmaVersion: 2022,
      sourceType: 'module',
      globals: { ...globals.node },
    },
  },
];
